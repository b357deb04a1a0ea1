"""DrafterServicer: decode -> call `Drafter` -> encode. Nothing else lives here.

Model work runs on one worker thread (services/engine/batcher.py). Continuous batching: the
Prefill and Draft calls that arrive while the head runs are gathered, in arrival order, into the next
batch (`Drafter.draft_many`: one head step per tree level for all their sequences, up to --max-batch
calls and --max-batch-rows rows); a call that fails fails alone. Release runs between batches.
Every answer carries the drafter's load as the sequence sees it (`busy`, drafter_svc/load.py: the
share of the last seconds spent on other sequences' batches), for the coordinator's overlap policy.
Draft and DraftAhead are idempotent per (sequence, round), numbered together:
the latest round's tree is kept and a repeated call (a retry after UNAVAILABLE) returns it instead
of extending the draft KV twice; so is a Prefill at its index with the same rows and root (a
verifier's Prefill to this drafter, verifier_svc/first_draft.py, that missed its deadline, then the
coordinator's own), in a later batch or in the same one; another Prefill under a held id is refused.
A verifier that drafts too (started with --draft) serves this servicer on its own port and calls
`draft_next` on its model thread after a batch's Verify calls that ask for it: the same `_run_batch`
(one at a time with the worker thread's), the same idempotency; and `prefill` for round 1's tree in
its own Prefill. DraftAhead (drafting ahead, services/spec/ahead.py) runs `Drafter.draft_ahead`
alone in its batch slot (its guessed rows are one-row head steps of its own).
"""

from __future__ import annotations


import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from services.engine.batcher import Batcher
from services.engine.drafter import DraftCall, Drafter, VerdictDraft
from services.errors import AerieError, InvalidRequest
from services.spec.cost import CostCurve
from services.spec.ahead_tree import ahead_rows
from services.spec.tree import TreeOnDevice, TreeParams
from services.spec.verify import NextRows
from services.metrics import DRAFT_SECONDS, SEQUENCES_IN_FLIGHT
from services.rpc import codec
from services.rpc.errors import rpc_errors
from services.rpc.reaper import IdleSequences, Reaper
from services.rpc.server import batch_observer, timed
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import drafter_grpc
from drafter_svc.config import DrafterConfig
from drafter_svc.load import DrafterLoad

SERVICE = "drafter"


class DrafterServicer(drafter_grpc.DrafterServicer):
    SERVICE = SERVICE

    def __init__(self, drafter: Drafter, config: DrafterConfig, draft_path: str, max_context: int,
                 costs: tuple[CostCurve, CostCurve] | None = None, top1_agreement: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`costs`: (head layer, projection) curves measured on this device, served by GetInfo;
        `clock`: the load meter's seconds (tests pass an explicit clock)."""
        self.load = DrafterLoad(clock=clock)
        self.costs = costs
        self.top1_agreement = top1_agreement
        self.drafter = drafter
        self.config = config
        self.draft_path = draft_path
        head = drafter.head.config
        self.vocab_size = head.vocab_size
        self.feature_size = head.feature_size
        self.dtype = drafter.head.feature_dtype  # the target's features (the draft may run in bf16/int8)
        self.max_rows = max_context + config.max_tree_nodes  # the server's cap, never the caller's
        self._last: dict[str, tuple[int, dpb.DraftResponse | QueuedDraft]] = {}  # sequence id -> latest (round, tree)
        self._prefilled: dict[str, tuple[int, int]] = {}  # sequence id -> its Prefill's rows and root (_rows_key)
        # the Drafter, `_last` and the load meter: the worker thread's, and a verifier's model thread's
        # when it drafts too (draft_next)
        self._lock = threading.Lock()
        self.batcher: Batcher[_Work] = Batcher("drafter", self._run_batch, rows=self._rows,
                                               key=lambda w: w.call.seq_id, limits=config.batch,
                                               on_batch=batch_observer(SERVICE), expect=lambda: self.drafter.num_sequences)
        self.idle = IdleSequences(config.idle_ttl_s)  # KV of a sequence nobody touches is reaped
        self.reaper = Reaper(SERVICE, self.idle, lambda seq_id: self.batcher.run(self._release, seq_id))

    def close(self) -> None:
        self.reaper.stop()
        self.batcher.close()

    # ---- RPCs --------------------------------------------------------------------------------------

    @rpc_errors
    async def Prefill(self, request_iterator, context) -> dpb.DraftResponse:
        first: dpb.DrafterPrefillRequest | None = None
        features = None
        async for msg in request_iterator:
            if first is None:
                first = msg
                seq_id = codec.sequence_id(msg.sequence_id)
                tokens = codec.token_ids(msg.tokens, self.vocab_size, "prefill")
                n = len(tokens)
                if n == 0:
                    raise InvalidRequest("prefill tokens must hold prompt[1:] and the first token; got none")
                if not n <= msg.max_rows <= self.max_rows:
                    raise InvalidRequest(f"max_rows must be in [{n}, {self.max_rows}] (this drafter's limit: the "
                                         f"target's context + AERIE_MAX_TREE_NODES); got {msg.max_rows}")
                features = codec.TensorAssembler("features", dtype=self.dtype, shape=(n, self.feature_size))
                params = self._params(msg)
            elif msg.sequence_id or msg.tokens or msg.max_rows:
                raise InvalidRequest("only the first Prefill message may carry sequence_id, max_rows and tokens")
            features.add(msg.features)
        if first is None:
            raise InvalidRequest("the Prefill stream carried no message")
        if first.round_index < 0:
            raise InvalidRequest(f"round_index must be >= 0 (0: 1); got {first.round_index}")
        call = DraftCall(seq_id, torch.tensor(tokens, dtype=torch.long), features.result(), params)
        return await self.prefill(call, first.round_index or 1, first.max_rows, first.sampling)

    async def prefill(self, call: DraftCall, round_index: int, max_rows: int, sampling: bool) -> dpb.DraftResponse:
        """A new draft KV of `max_rows` rows (`sampling`: paths sorted for rejection sampling) that takes
        call.tokens [n] (prompt[1:] and the first token) with call.features [n, F], and the first tree:
        the Prefill call, or a verifier that drafts too drafting round 1's tree inside its own Prefill
        (verifier_svc). A Prefill sent again at the index it ran at gets the same answer."""
        call = replace(call, features=call.features.to(self.dtype))
        return await timed(DRAFT_SECONDS.labels(SERVICE),
                           self.batcher.call_async(_Work(call, round_index, max_rows, sampling)))

    @rpc_errors
    async def Draft(self, request: dpb.DraftRequest, context) -> dpb.DraftResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        if request.round_index < 1:
            raise InvalidRequest(f"round_index must be >= 1; got {request.round_index}")
        tokens = codec.token_ids(request.tokens, self.vocab_size, "draft")
        if not tokens:
            raise InvalidRequest("draft tokens must hold the accepted tokens and the bonus; got none")
        features = codec.decode_tensor(request.features, "features", dtype=self.dtype,
                                       shape=(len(tokens), self.feature_size))
        params = self._params(request)
        first_row = request.first_row if request.HasField("first_row") else None
        if first_row is not None and first_row < 0:
            raise InvalidRequest(f"first_row must be >= 0; got {first_row}")
        call = DraftCall(seq_id, torch.tensor(tokens, dtype=torch.long), features, params, first_row)
        return await timed(DRAFT_SECONDS.labels(SERVICE), self.batcher.call_async(_Work(call, request.round_index)))

    def check_next(self, round_index: int, params: TreeParams | None) -> None:
        """A Verify's next_draft, checked before the Verify runs (InvalidRequest names the value)."""
        if round_index < 1:
            raise InvalidRequest(f"next_draft.round_index must be >= 1; got {round_index}")
        if params is not None:
            self.drafter.check_params(params)

    def draft_next(self, drafts: list[tuple[DraftCall, int]]) -> list[dpb.DraftResponse | BaseException]:
        """Drafts from inside this process, on the caller's thread: a verifier that drafts too
        (verifier_svc, --draft) drafts the next trees from its batch's verdicts on its model thread,
        right after their forward, all in one `draft_many`. Each (call: tokens [m + 1] the accepted
        tokens and the bonus, features [m + 1, F]; the Draft call's idempotency index) gets the answer
        a Draft call at that index gets. The caller checked them first (`check_next`)."""
        work = [_Work(replace(call, features=call.features.to(self.dtype)), index) for call, index in drafts]
        t0 = time.perf_counter()
        try:
            results = self._run_batch(work)
        except Exception as e:  # noqa: BLE001 (each draft's answer)
            results = [e] * len(work)
        DRAFT_SECONDS.labels(SERVICE).observe(time.perf_counter() - t0)
        return results

    def queue_from_verdict(self, seq_id: str, rows: NextRows, features: torch.Tensor, params: TreeParams,
                           round_index: int) -> VerdictDraft | None:
        """A verifier that drafts too, in a device round (verifier_svc/device_round.py): the next tree
        queued from the verdict still on the device (`Drafter.draft_from_verdict`; rows: its NextRows,
        features [W, F] their nodes' target features), for the Draft call at `round_index`; None where
        it cannot (that round answered already or older: the host path replays it; a draft that does
        not fit the static code). The draft KV takes the rows only with `commit_verdict`."""
        with self._lock:
            last = self._last.get(seq_id)
            if last is not None and round_index <= last[0]:
                return None
            t0 = self.load.clock()
            try:
                return self.drafter.draft_from_verdict(seq_id, rows, features.to(self.dtype), params)
            finally:
                self.load.ran(t0, self.load.clock(), {seq_id})

    def commit_verdict(self, seq_id: str, verdict: VerdictDraft, rows: int, round_index: int) -> QueuedDraft:
        """The host read the verdict a `queue_from_verdict` drafted from (its `rows`: the accepted
        tokens and the bonus): the draft KV keeps them, and the tree is the answer of the Draft call at
        `round_index` (a repeated one gets it: the same idempotency as `draft_next`'s)."""
        assert verdict.tree is not None  # (ranked: draft_from_verdict's default)
        with self._lock:
            self.drafter.commit(seq_id, rows)
            queued = QueuedDraft(verdict.tree)
            self._last[seq_id] = (round_index, queued)
            self.idle.touch(seq_id)
            return queued

    def busy(self, seq_id: str) -> float:
        """The drafter's load as `seq_id` sees it (DraftResponse.busy)."""
        with self._lock:
            return self.load.busy(seq_id)

    @rpc_errors
    async def DraftAhead(self, request: dpb.DraftAheadRequest, context) -> dpb.DraftResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        if request.round_index < 1:
            raise InvalidRequest(f"round_index must be >= 1; got {request.round_index}")
        tokens = codec.token_ids(request.tokens, self.vocab_size, "draft")
        guess = codec.token_ids(request.guess, self.vocab_size, "guess")
        if not 1 <= len(guess) <= self.drafter.tree.depth + 2:
            raise InvalidRequest(f"guess must hold 1 to {self.drafter.tree.depth + 2} tokens (the tree depth + 2); "
                                 f"got {len(guess)}")
        features = (codec.decode_tensor(request.features, "features", dtype=self.dtype,
                                        shape=(len(tokens), self.feature_size))
                    if tokens else torch.zeros(0, self.feature_size, dtype=self.dtype))
        branches = request.branches if request.HasField("branches") else None
        if branches is not None and branches < 0:
            raise InvalidRequest(f"branches must be >= 0 (0: one tree); got {branches}")
        chain = tuple(codec.token_ids(request.chain, self.vocab_size, "chain"))
        if len(chain) > self.drafter.tree.depth + 1:
            raise InvalidRequest(f"chain must hold at most {self.drafter.tree.depth + 1} tokens (the tree depth + 1); "
                                 f"got {len(chain)}")
        flat = codec.token_ids(request.exclude, self.vocab_size, "exclude")
        sizes = list(request.exclude_sizes)
        if any(n < 0 for n in sizes) or sum(sizes) != len(flat) or len(sizes) > len(chain) + 1:
            raise InvalidRequest(f"exclude_sizes must split the {len(flat)} exclude tokens into at most "
                                 f"{len(chain) + 1} lists (one per attach point); got {sizes}")
        offsets = [0, *itertools.accumulate(sizes)]
        exclude = tuple(tuple(flat[a:b]) for a, b in itertools.pairwise(offsets))
        call = DraftCall(seq_id, torch.tensor(tokens, dtype=torch.long), features, self._params(request))
        return await timed(DRAFT_SECONDS.labels(SERVICE), self.batcher.call_async(
            _Work(call, request.round_index, guess=tuple(guess), branches=branches, exclude=exclude, chain=chain)))

    @rpc_errors
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        return pb.ReleaseResponse(released=await self.batcher.exclusive_async(self._release, seq_id))

    @rpc_errors
    async def GetInfo(self, request: pb.InfoRequest, context) -> dpb.DrafterInfo:
        info = dpb.DrafterInfo(draft=self.draft_path, dtype=codec.dtype_name(self.dtype),
                               feature_kind=codec.WIRE_FEATURE_KINDS[self.drafter.feature_kind],
                               feature_size=self.feature_size, vocab_size=self.vocab_size,
                               tree=codec.encode_tree_params(self.drafter.tree),
                               max_sequences=self.drafter.max_sequences, num_sequences=self.drafter.num_sequences,
                               fixed_tree=self.config.tree is not None, top1_agreement=self.top1_agreement)
        if self.costs is not None:
            info.head_cost.CopyFrom(codec.encode_cost(self.costs[0]))
            info.logits_cost.CopyFrom(codec.encode_cost(self.costs[1]))
        return info

    def _params(self, msg) -> TreeParams | None:
        """The request's tree shape, checked against this drafter (InvalidRequest names the value)."""
        if not msg.HasField("tree"):
            return None
        params = codec.decode_tree_params(msg.tree)
        self.drafter.check_params(params)
        return params

    # ---- on the worker thread ------------------------------------------------------------------------

    def _rows(self, work: "_Work") -> int:
        """Head rows the call costs: its committed rows (and guessed rows) plus its tree's expansion rows
        (an ahead tree's: its branches' rows)."""
        tree = work.call.params or self.drafter.tree
        expansion = tree.draft_rows
        if work.guess is not None:
            branches = self.drafter.ahead_branches if work.branches is None else min(work.branches,
                                                                                     self.drafter.ahead_branches)
            expansion = len(work.chain) + ahead_rows(tree, (len(work.chain) + 1) * branches) if branches else tree.draft_rows
        return int(work.call.tokens.shape[0]) + len(work.guess or ()) + expansion

    def _run_batch(self, batch: list["_Work"]) -> list:
        """Start the prefills, answer replays, then grow every other tree in one `draft_many`; each
        answer carries the load its sequence sees (this batch's other sequences included). On the
        worker thread, or a verifier's model thread (`draft_next`): one at a time (`_lock`)."""
        with self._lock:
            t0 = self.load.clock()
            try:
                results = self._answer(batch)
            finally:
                self.load.ran(t0, self.load.clock(), {w.call.seq_id for w in batch})
            for w, r in zip(batch, results, strict=True):
                if isinstance(r, dpb.DraftResponse):
                    r.busy = self.load.busy(w.call.seq_id)
        return results

    def _answer(self, batch: list["_Work"]) -> list:
        results: list = [None] * len(batch)
        todo: list[int] = []
        started: dict[str, int] = {}  # sequence id -> the Prefill of this batch that starts its KV
        again: list[tuple[int, int]] = []  # (a Prefill sent again within this batch, the one it repeats)
        for i, w in enumerate(batch):
            seq_id = w.call.seq_id
            try:
                if w.max_rows is not None:  # Prefill: a new draft KV
                    last = self._last.get(seq_id)
                    if (last is not None and w.round_index == last[0]  # (`_last` goes with the KV)
                            and self._prefilled.get(seq_id) == _rows_key(w)):
                        # sent again (a verifier's call to this drafter that missed its deadline; a retry)
                        results[i] = last[1].response() if isinstance(last[1], QueuedDraft) else last[1]
                        continue
                    first = started.get(seq_id)
                    if (first is not None and batch[first].round_index == w.round_index
                            and _rows_key(batch[first]) == _rows_key(w)):
                        again.append((i, first))  # (the retry arrived before the first one ran)
                        continue
                    self.drafter.start(seq_id, w.max_rows, w.sampling)
                    started[seq_id] = i
                    self.idle.touch(seq_id)
                else:
                    if seq_id in self._last:
                        self.idle.touch(seq_id)
                    last = self._last.get(seq_id)
                    if last is not None and w.round_index == last[0]:
                        results[i] = last[1].response() if isinstance(last[1], QueuedDraft) else last[1]
                        continue
                    if last is not None and w.round_index < last[0]:
                        raise InvalidRequest(f"round {w.round_index} of sequence {seq_id!r} is older than its "
                                             f"latest round {last[0]}")
            except Exception as e:  # noqa: BLE001 (this call's answer)
                results[i] = e
                continue
            if w.guess is not None:  # DraftAhead: alone (guessed rows, then the ahead tree)
                results[i] = self._draft_ahead(w)
                continue
            todo.append(i)
        if todo:
            try:
                trees = self.drafter.draft_many([batch[i].call for i in todo])
            except BaseException:
                for i in todo:
                    if batch[i].max_rows is not None:
                        self.drafter.release(batch[i].call.seq_id)
                raise
            for i, tree in zip(todo, trees):
                w = batch[i]
                if isinstance(tree, BaseException):
                    if w.max_rows is not None:
                        self.drafter.release(w.call.seq_id)  # a failed prefill holds nothing
                    results[i] = tree
                    continue
                response = dpb.DraftResponse(tree=codec.encode_tree(tree))
                # the prefill's tree is the one round 1 verifies
                self._last[w.call.seq_id] = (w.round_index, response)
                if w.max_rows is not None:
                    self._prefilled[w.call.seq_id] = _rows_key(w)
                results[i] = response
        for i, first in again:
            results[i] = results[first]
        SEQUENCES_IN_FLIGHT.labels(SERVICE).set(self.drafter.num_sequences)
        return results

    def _draft_ahead(self, w: "_Work") -> dpb.DraftResponse | BaseException:
        try:
            tree = self.drafter.draft_ahead(w.call.seq_id, w.call.tokens, w.call.features, list(w.guess or ()),
                                            w.call.params, w.round_index, w.branches, w.exclude, w.chain)
        except AerieError as e:
            return e
        response = dpb.DraftResponse() if tree is None else dpb.DraftResponse(tree=codec.encode_tree(tree))
        self._last[w.call.seq_id] = (w.round_index, response)
        return response

    def _release(self, seq_id: str) -> bool:
        with self._lock:
            self._last.pop(seq_id, None)
            self._prefilled.pop(seq_id, None)
            self.idle.forget(seq_id)
            before = self.drafter.num_sequences
            self.drafter.release(seq_id)
            SEQUENCES_IN_FLIGHT.labels(SERVICE).set(self.drafter.num_sequences)
            return self.drafter.num_sequences < before


def _rows_key(w: "_Work") -> tuple[int, int]:
    """What tells a Prefill sent again from another under the same id: its rows and its root token."""
    return int(w.call.tokens.shape[0]), int(w.call.tokens[-1])


class QueuedDraft:
    """A tree queued from a verdict on the device (`commit_verdict`): `response()` waits for its
    candidates and encodes it, once (any thread; a Draft call repeated at its round too)."""

    def __init__(self, tree: TreeOnDevice) -> None:
        self.tree = tree
        self._response: dpb.DraftResponse | None = None
        self._lock = threading.Lock()

    def response(self) -> dpb.DraftResponse:
        with self._lock:
            if self._response is None:
                self._response = dpb.DraftResponse(tree=codec.encode_tree(self.tree.host()))
        return self._response


@dataclass(frozen=True, slots=True)
class _Work:
    call: DraftCall
    round_index: int  # a Prefill's: 1, or past the calls before a rebuild (DrafterPrefillRequest.round_index)
    max_rows: int | None = None  # a Prefill: the draft KV to reserve
    sampling: bool = False  # a Prefill: sampling paths order
    guess: tuple[int, ...] | None = None  # a DraftAhead: the guessed committed tokens
    branches: int | None = None  # a DraftAhead: likely bonuses to grow subtrees under (None: the drafter's)
    exclude: tuple[tuple[int, ...], ...] = ()  # a DraftAhead: tokens that are no branch, per attach point
    chain: tuple[int, ...] = ()  # a DraftAhead: the top path past the guess

