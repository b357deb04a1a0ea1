"""VerifierServicer: decode -> call `Verifier` -> encode. Nothing else lives here.

Model work runs on one worker thread (services/engine/batcher.py), so the event loop stays free for
health checks and other calls. Continuous batching: the Prefill, Verify and Decode calls that arrive
while a forward runs are gathered, in arrival order, into the next forward (`Verifier.run`: one
target forward for all of them, up to --max-batch calls and --max-batch-rows rows); a call that
fails (unknown sequence, KV that does not fit, ...) fails alone. Release runs between batches. Each
sequence's drafter decides which features it needs (hidden / taps / none, given at Prefill).

Verify and Decode are idempotent per (sequence, round): the latest round's response is kept and a
repeated call (a retry after UNAVAILABLE) returns it instead of running the round twice.

A verifier that drafts too (--draft: a head over this target, its Drafter service on the same port,
drafter_svc.servicer): a Verify with `next_draft` also drafts the next tree from its verdict, the Draft
the coordinator would otherwise send after it (tokens[1:] and the bonus, their features), and answers
with both: one call per EAGLE round instead of a Verify and a Draft, and the features never leave
the process. The drafts of a batch's Verify calls run on the model thread right after their forward,
in one batch of the head (`DrafterServicer.draft_next`: its per-round idempotency too); the tree is
part of the stored answer, so a repeated Verify gets the same tree again. A draft that fails (the
head lost the sequence) leaves the answer without a tree: the coordinator drafts with a Draft call.

Direct drafts (`next_draft.drafter`: the sequence's drafter in another process, coordinator
--direct-drafts; verifier_svc/direct_draft.py): the same next draft, sent to that drafter on the event
loop once the forward has answered (the model thread goes on with other calls); a drafter that fails
leaves the answer a plain Verify's.

VerifyRun (a verifier that drafts too, or direct drafts): a run of tree rounds, each a NextDraftVerify
through the batcher whose answer, once its next tree is drafted, queues the next round with that tree
before the answer reaches the caller (here: RunChain with a `follow` of its own; direct: the loop of
`_direct_run`), until `rounds`, max_tokens, a stop id, a round that drafted nothing, or a round that
was a single Verify's answer given again (a run computes a round only after one of its own: the
engine holds a run's trees only for those). Every round it ran is kept (RunAnswers): a Verify at one
of them, a broken stream's retry, gets its answer again. A verifier that drafts too keeps a greedy
run's rounds on the device where it can (verifier_svc/device_round.py: the next tree queued from the
verdict, the next round queued before the draft is read; the answer a QueuedVerify).

DecodeRun (verifier_svc/plain_run.py): a run of plain steps, each an ordinary decode call through
the batcher, the next queued by the model thread as soon as the previous token is known (on a GPU,
`queue_runs`, for a greedy sequence without a penalty or logprobs: as soon as its step is queued,
its token still on the device and read off the model thread). Every
round of the sequence's latest run is kept, so that after a broken run stream a Decode or DecodeRun
at any round the run computed is answered again, never run twice.

A prefill comes whole (one call; --prefill-chunk splits it into forwards here) or, from a coordinator,
chunk by chunk (`offset`, `more`: each chunk its own call and deadline, see proto/aerie/v1/verifier.proto).
A chunk call that fails leaves the rows prefilled so far in place, so the caller resumes from them;
the latest chunk's answer is kept until the sequence's first Verify or Decode, so a chunk sent again
after its deadline (it ran meanwhile) is answered from it instead of running twice.

Steps (services/engine/step_scheduler.py): each forward serves every queued Verify/Decode first, then
prefill rows up to a token budget: the most rows whose predicted forward fits --itl-target-ms (or,
auto, 3 plain steps), at least STEP_FLOOR_ROWS; the prediction is learned from the steps that ran,
seeded from `verify_cost` (services/engine/step_cost.py). While a sequence decodes here, a prefill call that does not
fit is cut into `Slice`s, one per step (the rest keeps its place in the queue): a coordinator's
512-row chunk stays one RPC with one deadline but runs as several budget-sized forwards next to the
decodes, and as one forward when no sequence decodes (a prompt alone loses nothing to the budget).

KV shares (services/engine/kv_shares.py): each client identity (gRPC metadata `aerie-client`, set by
the coordinator: the caller's API identity, else its peer host) may hold at most --kv-client-share of
the KV budget while other identities hold or wait for KV; alone it may use all of it. A Prefill over
its identity's share waits like one over the budget, and is refused naming the share: the greedy
identity is refused, the others are admitted as KV is released.

KV growth (services/engine/kv_growth.py, --kv-growth-rows): a Prefill reserves its whole prompt (at
its first chunk) and one increment; slots grow as the sequences write rows, and the budget and the shares count the rows
reserved. When the budget cannot hold a growth, the youngest sequence is preempted: its KV is
released, its next call gets NOT_FOUND ("... was preempted ...") and its coordinator prefills it again
from its committed tokens. Such a rebuild goes first: while one waits for KV, no new sequence is
admitted; it is not held to its client's share (it was admitted under it once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from services.device import device_memory, free_memory_bytes, is_gpu
from services.engine.batcher import Batcher
from services.engine.kv_shares import ANONYMOUS, KVShares
from services.engine.step_cost import AUTO_RATIO, StepBudget, StepCost, pair_flops
from services.engine.step_scheduler import step_rows
from services.engine.drafter import DraftCall
from services.engine.local import device_round
from services.engine.verifier import (Call, DecodeCall, PrefillCall, PrefillMoreCall, PrefillResult, Verifier,
                                      VerifyCall, VerifyResult, merge_prefill)
from services.errors import AerieError, CapacityExceeded, InvalidRequest, KVBudgetExceeded, SequencePreempted
from services import metrics
from services.metrics import PREFILL_SECONDS, SEQUENCES_IN_FLIGHT, VERIFY_SECONDS
from services.model.kv_pool import KVPool
from services.model.runner import ModelRunner, paged_default, pool_for, warm_up_at_start
from services.model.target import TargetModel
from services.rpc import codec
from services.rpc.config import ConfigError
from services.rpc.errors import rpc_errors
from services.rpc.reaper import IdleSequences, Reaper
from services.rpc.server import batch_observer, timed
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.cost import CostCurve
from services.spec.overlap import RunAhead
from services.spec.tree import TreeOnDevice, TreeParams, tree_on_device
from verifier_svc.config import AUTO, VerifierConfig
from verifier_svc.ahead_run import AheadRun, decode_run_ahead
from verifier_svc.device_round import DeviceRounds, QueuedVerify
from verifier_svc.direct_draft import DirectDrafts, NextDraftTo, check_address
from verifier_svc.first_draft import FirstDrafts
from verifier_svc.plain_run import END, QueuedAnswer, QueuedToken, RunAnswers, RunChain, RunStep, check_steps

log = logging.getLogger("aerie.verifier")

SERVICE = "verifier"
DIRECT_DRAFT_TIMEOUT_S = 10.0  # a direct draft's deadline at most (within its Verify's own): then the coordinator drafts
CLIENT_METADATA = "aerie-client"  # the identity a Prefill's KV counts against (set by the coordinator)
STEP_FLOOR_ROWS = 16  # a step's token budget never goes below this (a slow CPU still prefills); 16, not 32:
#   at an 8k offset 32 prompt rows alone cost 0.75 s on the 2-core CPU of docs/distributed.md


class NextDrafter(Protocol):
    """A head in this process (drafter_svc.servicer.DrafterServicer): a verifier started with --draft
    drafts the next trees from its batch's verdicts, for the Verify calls that ask (NextDraftVerify)."""

    def check_next(self, round_index: int, params: TreeParams | None) -> None: ...

    def draft_next(self, drafts: list[tuple[DraftCall, int]]) -> list: ...

    async def prefill(self, call: DraftCall, round_index: int, max_rows: int, sampling: bool
                      ) -> dpb.DraftResponse: ...


@dataclass(frozen=True, slots=True)
class NextDraftVerify(VerifyCall):
    """A Verify that also drafts the next tree from its verdict (VerifyRequest.next_draft)."""
    next_round: int = 0  # the Draft call's idempotency index the draft stands for
    next_params: TreeParams | None = None  # its shape (None: the head's largest)
    run: bool = False  # a round of a VerifyRun (its answer is kept per round, RunAnswers)
    drafter: str = ""  # the sequence's drafter in another process (host:port; verifier_svc/direct_draft.py); "": here
    device: bool = False  # a run's device round (verifier_svc/device_round.py): its tree a TreeOnDevice

    @property
    def direct(self) -> NextDraftTo:
        return NextDraftTo(self.next_round, self.next_params, self.drafter)


@dataclass(frozen=True, slots=True)
class FirstChunk(PrefillCall):
    """The first chunk of a prefill that the caller sends chunk by chunk (more=True)."""
    offset: int = 0


@dataclass(frozen=True, slots=True)
class NextChunk(PrefillMoreCall):
    """A later chunk of a prefill that the caller sends chunk by chunk: prompt rows [offset, offset + rows)."""
    offset: int = 0


ChunkCall = FirstChunk | NextChunk


@dataclass(frozen=True, slots=True)
class Slice:
    """Prompt rows [start, stop) of a prefill call (`whole`: a PrefillCall / PrefillMoreCall or a
    chunk of either kind) that a step cut to fit its token budget (services/engine/batcher.py). The
    slices of one call run in order, one per step; the last answers for the whole call. Example: a
    512-row NextChunk cut at 84 rows -> Slice(chunk, 0, 84), then Slice(chunk, 84, 512) (cut again
    while decodes run)."""
    whole: PrefillCall | PrefillMoreCall
    start: int
    stop: int

    @property
    def seq_id(self) -> str:
        return self.whole.seq_id

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def split(self, rows: int) -> tuple[Slice, Slice]:
        return Slice(self.whole, self.start, self.start + rows), Slice(self.whole, self.start + rows, self.stop)

    def part(self) -> PrefillCall | PrefillMoreCall:
        """The engine call for these rows: the first slice of a PrefillCall admits the sequence
        (more=True); every later one extends it, the last slice of the last rows samples the token."""
        w = self.whole
        prompt = w.prompt[self.start:self.stop]  # [rows] long
        if self.start == 0 and isinstance(w, PrefillCall):
            return PrefillCall(w.seq_id, prompt, w.sampling, w.capacity, w.feature_kind, more=True,
                               prompt_rows=max(w.rows, w.prompt_rows))
        ends = self.stop == w.rows
        last = ends and (not w.more if isinstance(w, PrefillCall) else w.last)
        return PrefillMoreCall(w.seq_id, prompt, last=last)


class ChunkAnswer(NamedTuple):
    """A chunk's answer, stored for the chunk sent again: the verifier's result and, for the last
    chunk of a sequence that asks for them, the first token's logprobs (else None)."""
    result: PrefillResult
    logprobs: pb.TokenLogprobs | None


class VerifierServicer(verifier_grpc.VerifierServicer):
    SERVICE = SERVICE

    def __init__(self, target: TargetModel, config: VerifierConfig, target_path: str,
                 eos_token_ids: tuple[int, ...], verify_cost: CostCurve | None = None,
                 runner: ModelRunner | None = None, drafter: NextDrafter | None = None) -> None:
        """`verify_cost`: t_verify(rows) measured on this device, served by GetInfo for the budget;
        `runner`: the model runner (None: a local ModelRunner over `target`); `drafter`: the head this
        process serves too (--draft), which drafts the next tree in a Verify that asks for it."""
        self.drafter_servicer = drafter
        self._direct: DirectDrafts | None = None  # channels to drafters (opened by the first direct draft)
        self._first = FirstDrafts()  # prompts whose round-1 tree is drafted in their Prefill, until the last chunk
        self.verify_cost = verify_cost
        self.target = target
        self.config = config
        self.target_path = target_path
        self.eos_token_ids = eos_token_ids
        self.vocab_size = target.config.vocab_size
        self.max_context = context_limit(target.config.max_context, config.max_model_len)  # GetInfo's
        # capacity = prompt + max_new_tokens (<= max_context) + one tree, capped by this server's config
        # (AERIE_MAX_SEQUENCE_ROWS / AERIE_MAX_TREE_NODES), never by the caller
        self.max_capacity = config.max_sequence_rows or self.max_context + config.max_tree_nodes
        # one runner (one KV pool) and one Verifier for every sequence, whatever features it returns
        if runner is None and paged_default(target.device):  # CUDA (the CPU with AERIE_PAGED_KV=1)
            # the paged arena is allocated once, at start: size it by the KV budget itself
            budget = kv_budget_rows(config, KVPool.for_model(target).bytes_per_row, str(target.device))
            runner = ModelRunner(target, pool_for(target, budget))
        self.runner = runner if runner is not None else ModelRunner(target)
        warm_up_at_start(self.runner, config.max_sequences)  # CUDA: graphs before the first request
        pool = getattr(self.runner, "pool", None)  # a local runner's pool (a TP group: not applied)
        if pool is not None:
            pool.max_rows = kv_budget_rows(config, pool.bytes_per_row, str(target.device))
            if pool.max_rows:  # KV usage for dashboards and autoscalers (vLLM's kv_cache_usage_perc)
                metrics.KV_CACHE_USAGE.labels(metrics.model_label(target_path)).set_function(
                    lambda: pool.rows_allocated / pool.max_rows)
        self._kv_waiting = 0  # Prefills waiting for KV under the budget
        self.shares = KVShares(pool.max_rows if pool is not None else None, config.kv_client_share)
        # the token budget of one step from the start-up curve (None: no ITL target or no measured cost;
        # what the budget starts from) ...
        auto = config.itl_target_ms == AUTO
        target_s = None if auto else config.itl_target_ms / 1000  # auto: AUTO_RATIO x a plain step's time
        on = (auto or target_s > 0) and verify_cost is not None
        self.step_rows = (step_rows(verify_cost, AUTO_RATIO * verify_cost(1) if auto else target_s, STEP_FLOOR_ROWS,
                                    config.batch.max_rows) if on else None)
        # ... which the steps then learn (services/engine/step_cost.py): the start-up curve is only the prior
        self.step_budget: StepBudget | None = None
        if on:
            m = target.config  # the attention term's prior: a pair's FLOPs against a row's
            pairs = pair_flops(m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim)
            self.step_budget = StepBudget(StepCost.from_curve(verify_cost, pairs), target_s, STEP_FLOOR_ROWS,
                                          config.batch.max_rows)
        self.prefill_chunk = config.prefill_chunk  # the RPC's chunk; steps slice it (Slice)
        self.verifier = Verifier(target, "hidden", config.max_sequences, self.runner, config.kv_growth_rows,
                                 on_preempt=self._preempted, on_grow=self.shares.hold)
        # a verifier that drafts too keeps its runs' tree rounds on the device where it can (AERIE_DEVICE_ROUND)
        self.device_rounds = (DeviceRounds(drafter, self.verifier)  # type: ignore[arg-type]
                              if drafter is not None and device_round() is not False else None)
        self._rebuilds_waiting: set[str] = set()  # preempted sequences whose Prefill waits for KV
        self._kind: dict[str, str] = {}  # sequence id -> the feature kind its drafter needs
        self.group = runner if getattr(runner, "world", 1) > 1 else None  # a TP group: its `alive` drives health
        self._last: dict[str, tuple[int, object]] = {}  # sequence id -> (round, response) for replays
        self._run_answers = RunAnswers()  # sequence id -> its latest run's answers per round, for replays
        # runs queue each step on the device before the previous token is read (verifier_svc/plain_run.py):
        # on a GPU, where the device then computes while the model thread launches (on the CPU a step
        # runs as it is launched: nothing would overlap)
        self.queue_runs = is_gpu(str(target.device))
        # sequence id -> (offset, rows prefilled after it, answer) of its latest chunk, for a chunk sent again
        self._chunks: dict[str, tuple[int, int, ChunkAnswer]] = {}
        self._slices: dict[str, list[PrefillResult]] = {}  # sequence id -> its call's slices' answers so far
        self._prefilling: set[str] = set()  # admitted sequences whose prompt is not complete yet
        self.batcher: Batcher[Call] = Batcher("verifier", self._run_batch, rows=lambda c: c.rows,
                                              key=lambda c: c.seq_id, limits=config.batch,
                                              on_batch=batch_observer(SERVICE), expect=lambda: len(self._kind),
                                              prefill=lambda c: isinstance(c, (PrefillCall, PrefillMoreCall, Slice)),
                                              step_rows=self.step_rows, split=_split, splittable=self._splittable,
                                              decoding=lambda: len(self._kind) - len(self._prefilling),
                                              budget=self.step_budget, prefix=lambda c: self.verifier.length(c.seq_id))
        self.idle = IdleSequences(config.idle_ttl_s)  # KV of a sequence nobody touches is reaped
        self.reaper = Reaper(SERVICE, self.idle, lambda seq_id: self.batcher.run(self._release, seq_id))

    async def close_channels(self) -> None:
        """Close the channels direct drafts opened to drafters (on the event loop that opened them: the
        server's, at its stop); a later direct draft opens them again."""
        direct, self._direct = self._direct, None
        if direct is not None:
            await direct.close()

    def close(self) -> None:
        self.reaper.stop()
        self.batcher.close()
        close_drafter = getattr(self.drafter_servicer, "close", None)
        if close_drafter is not None:
            close_drafter()
        if self.group is not None:
            self.group.close()
            watcher = getattr(self, "watcher", None)  # verifier_svc/server.py watch_group
            if watcher is not None and not watcher.done():
                watcher.get_loop().call_soon_threadsafe(watcher.cancel)

    @property
    def num_sequences(self) -> int:
        return len(self._kind)

    # ---- RPCs --------------------------------------------------------------------------------------

    @rpc_errors
    async def Prefill(self, request: vpb.VerifierPrefillRequest, context):
        seq_id = codec.sequence_id(request.sequence_id)
        n, offset, more = len(request.prompt_ids), request.offset, request.more
        if n == 0:
            raise InvalidRequest("prompt is empty: give at least one token")
        total = request.prompt_tokens or offset + n  # the whole prompt's rows
        if offset < 0 or offset + n > total or more != (offset + n < total):
            raise InvalidRequest(f"a chunk of {n} tokens at offset {offset} (more={more}) does not fit a "
                                 f"{total}-token prompt (prompt_tokens)")
        if total > self.config.max_prompt_tokens and not request.rebuild:
            raise CapacityExceeded(f"prompt has {total} tokens; this verifier accepts at most "
                                   f"{self.config.max_prompt_tokens} (AERIE_MAX_PROMPT_TOKENS)")
        prompt = torch.tensor(codec.token_ids(request.prompt_ids, self.vocab_size, "prompt"), dtype=torch.long)
        sampling = codec.decode_sampling(request.sampling)
        if request.rebuild:  # a rebuild's rows were scored by the first prefill (its client has them)
            sampling = replace(sampling, prompt_logprobs=None)
        kind = codec.feature_kind(request.feature_kind)
        if not total < request.capacity <= self.max_capacity:
            raise InvalidRequest(f"capacity must be in [{total + 1}, {self.max_capacity}] for a {total}-token prompt "
                                 f"(this verifier's limit, AERIE_MAX_SEQUENCE_ROWS); got {request.capacity}")
        first = self._first_draft(seq_id, request.next_draft, offset) if request.HasField("next_draft") else None
        client = _client(context)
        if offset == 0 and not more:
            work = self._prefill(PrefillCall(seq_id, prompt, sampling, request.capacity, kind), client)
        elif offset == 0:
            work = self._admit(FirstChunk(seq_id, prompt, sampling, request.capacity, kind, more=True,
                                          prompt_rows=total), client)
        else:
            work = self.batcher.call_async(NextChunk(seq_id, prompt, last=not more, offset=offset))
        answer = await timed(PREFILL_SECONDS.labels(SERVICE), work)
        if isinstance(answer, ChunkAnswer):  # a chunk of the caller's: its logprobs came with it
            result, logprobs = answer
        else:
            result = answer
            logprobs = codec.encode_logprobs(self.verifier.take_logprobs(seq_id))  # None unless asked for
        prompt_logprobs = codec.encode_logprobs(result.prompt_logprobs)  # None unless asked for
        features, drafted, draft_s = result.features, None, 0.0
        if first is not None:  # round 1's tree here: the prompt's features stay (verifier_svc/first_draft.py)
            t0 = time.perf_counter()
            features, drafted = await self._first.take(
                seq_id, offset, prompt, result.first_token, result.features, more,
                lambda tokens, rows: self._draft_first(seq_id, first, tokens, rows, request.capacity,
                                                       not sampling.greedy, context))
            draft_s = time.perf_counter() - t0
        room = self.config.service.chunk_bytes - (prompt_logprobs.ByteSize() if prompt_logprobs is not None else 0)
        for i, chunk in enumerate(codec.tensor_chunks(features, self.config.service.chunk_bytes, room)):
            response = vpb.VerifierPrefillResponse(
                first_token=result.first_token if i == 0 else 0, features=chunk, logprobs=logprobs if i == 0 else None,
                prompt_logprobs=prompt_logprobs if i == 0 else None)
            if i == 0 and drafted is not None:
                response.next_tree.CopyFrom(drafted.tree)
                response.next_draft_seconds = draft_s
                response.drafter_busy = drafted.busy
            yield response

    def _first_draft(self, seq_id: str, nxt: vpb.NextDraft, offset: int) -> NextDraftTo:
        """A Prefill's next_draft (round 1's tree in the same call), checked before the prefill runs."""
        if nxt.round_index < 1:
            raise InvalidRequest(f"next_draft.round_index must be >= 1 (the drafter's Prefill index); "
                                 f"got {nxt.round_index}")
        params = codec.decode_tree_params(nxt.tree) if nxt.HasField("tree") else None
        drafter = self._drafter_of(nxt, params)
        self._first.check(seq_id, offset)
        return NextDraftTo(nxt.round_index, params, drafter)

    def _drafter_of(self, nxt: vpb.NextDraft, params: TreeParams | None) -> str:
        """Where a next_draft drafts: its drafter's address, checked, or "" (this verifier's head, which
        checks the index and the shape); InvalidRequest names the value."""
        if nxt.drafter:
            return check_address(nxt.drafter)
        if self.drafter_servicer is None:
            raise InvalidRequest("next_draft: this verifier drafts nothing (start it with --draft to serve a head "
                                 "too, or name the sequence's drafter in next_draft.drafter)")
        self.drafter_servicer.check_next(nxt.round_index, params)
        return ""

    async def _draft_first(self, seq_id: str, nxt: NextDraftTo, tokens: torch.Tensor, features: torch.Tensor,
                           max_rows: int, sampling: bool, context):
        """The drafter's Prefill of a prompt prefilled here (tokens [L] prompt[1:] and the first token,
        features [L, F]): this process's head, or the sequence's drafter (direct_draft.py); None when
        it failed (logged: the coordinator drafts)."""
        if nxt.drafter:
            if self._direct is None:
                self._direct = DirectDrafts(self.config.service)
            drafted = await self._direct.prefill(seq_id, nxt, tokens, features, max_rows, sampling,
                                                 self._draft_timeout(context))
            metrics.DIRECT_DRAFTS.labels(SERVICE, "drafted" if drafted is not None else "failed").inc()
            return drafted
        assert self.drafter_servicer is not None  # (_first_draft checked)
        try:
            return await self.drafter_servicer.prefill(DraftCall(seq_id, tokens, features, nxt.params), nxt.index,
                                                       max_rows, sampling)
        except AerieError as e:
            log.info("sequence %s: round 1's draft in its Prefill failed (%s); its coordinator drafts", seq_id, e)
            return None

    async def _prefill(self, call: PrefillCall, client: str) -> PrefillResult:
        """The whole prompt in one forward, or in chunks of the prefill chunk (--prefill-chunk, cut to
        the step budget), each its own batcher call: other sequences' rounds run between the chunks
        instead of waiting for the whole prompt."""
        chunk = self.prefill_chunk
        if not chunk or call.rows <= chunk:
            return await self._admit(call, client)
        parts = call.prompt.split(chunk)
        first = await self._admit(replace(call, prompt=parts[0], more=True, prompt_rows=call.rows), client)
        done = [first]
        try:
            for k, part in enumerate(parts[1:], 1):
                done.append(await self.batcher.call_async(PrefillMoreCall(call.seq_id, part,
                                                                          last=k == len(parts) - 1)))
        except BaseException:
            await self.batcher.exclusive_async(self._release, call.seq_id)  # never partially admitted
            raise
        return merge_prefill(done)

    async def _admit(self, call: PrefillCall, client: str = ANONYMOUS):
        """Prefill under the KV budget and `client`'s share of it: a sequence whose KV does not fit
        now waits (at most --kv-wait-s, at most --kv-queue of them) for other sequences to release
        theirs, then is refused with RESOURCE_EXHAUSTED naming the budget (or the share); never
        partially admitted."""
        deadline = time.monotonic() + self.config.kv_wait_s
        queued = False
        self.shares.claim(call.seq_id, client)
        try:
            while True:
                try:
                    return await self.batcher.call_async(call)
                except KVBudgetExceeded as e:
                    if not e.fits_empty:
                        raise
                    if not queued and self._kv_waiting >= self.config.kv_queue:
                        raise KVBudgetExceeded(f"{e}; {self._kv_waiting} Prefills already wait for KV "
                                               f"(AERIE_KV_QUEUE={self.config.kv_queue})") from None
                    if time.monotonic() >= deadline:
                        raise KVBudgetExceeded(f"{e}; waited {self.config.kv_wait_s:g} s for KV to be released "
                                               f"(AERIE_KV_WAIT_S)") from None
                    if not queued:
                        queued = True
                        self._kv_waiting += 1
                        self.shares.wait(client)
                        if self._was_preempted(call.seq_id):
                            self._rebuilds_waiting.add(call.seq_id)  # it goes first
                    await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        finally:
            self._rebuilds_waiting.discard(call.seq_id)
            if queued:
                self._kv_waiting -= 1
                self.shares.done_waiting(client)
            if call.seq_id not in self._kind:
                self.shares.unclaim(call.seq_id)  # not admitted

    @rpc_errors
    async def Verify(self, request: vpb.VerifyRequest, context) -> vpb.VerifyResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        tree = codec.decode_tree(request.tree, self.vocab_size, self.config.max_tree_nodes)
        call = VerifyCall(seq_id, tree, request.round_index)
        if request.HasField("next_draft"):
            call = self._next_draft_call(call, request.next_draft)
        response = await self._verify(call)
        if isinstance(call, NextDraftVerify) and call.drafter and not response.HasField("next_tree"):
            await self._draft_direct(call, response, context)
        return response

    async def _verify(self, call: VerifyCall) -> vpb.VerifyResponse:
        """A verify through the batcher, its seconds here (queueing and batching included) in the answer
        (a stored answer given again keeps the seconds it was computed in: a replay is the same bytes)."""
        t0 = time.perf_counter()
        response = await timed(VERIFY_SECONDS.labels(SERVICE), self.batcher.call_async(call))
        if not response.verify_seconds and (not response.round_index or isinstance(call, NextDraftVerify)
                                            and call.run):  # (a run's answer given to a Verify: as it was)
            response.verify_seconds = time.perf_counter() - t0
        return response

    def _next_draft_call(self, call: VerifyCall, nxt: vpb.NextDraft, run: bool = False) -> NextDraftVerify:
        """A Verify that drafts the next tree too: here (this verifier's head) or at `nxt.drafter`
        (verifier_svc/direct_draft.py); its values checked before the verify runs."""
        params = codec.decode_tree_params(nxt.tree) if nxt.HasField("tree") else None
        if nxt.drafter and nxt.round_index < 2:
            raise InvalidRequest(f"next_draft.round_index must be >= 2 (1 is the drafter's prefill); "
                                 f"got {nxt.round_index}")
        drafter = self._drafter_of(nxt, params)
        return NextDraftVerify(call.seq_id, call.tree, call.round_index, next_round=nxt.round_index,
                               next_params=params, run=run, drafter=drafter)

    async def _draft_direct(self, call: NextDraftVerify, response: vpb.VerifyResponse, context) -> bool:
        """The next tree from `response`'s verdict at the sequence's drafter (direct_draft.py), within
        the call's deadline."""
        if self._direct is None:
            self._direct = DirectDrafts(self.config.service)
        drafted = await self._direct.draft(call.seq_id, call.direct, response, self._draft_timeout(context))
        metrics.DIRECT_DRAFTS.labels(SERVICE, "drafted" if drafted else "failed").inc()
        return drafted

    @staticmethod
    def _draft_timeout(context) -> float:
        """A call to the drafter: at most DIRECT_DRAFT_TIMEOUT_S, within the caller's deadline."""
        remaining = context.time_remaining() if context is not None else None
        return DIRECT_DRAFT_TIMEOUT_S if remaining is None else min(remaining, DIRECT_DRAFT_TIMEOUT_S)

    @rpc_errors
    async def VerifyRun(self, request: vpb.VerifyRunRequest, context):
        """Tree rounds back to back, each next tree drafted from the verdict before it (module doc)."""
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        check_steps(request.rounds)
        if not request.HasField("next_draft"):
            raise InvalidRequest("VerifyRun needs next_draft (the first next draft's index and the shape)")
        if request.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1; got {request.max_tokens}")
        stop_ids = frozenset(codec.token_ids(request.stop_ids, self.vocab_size, "stop_ids"))
        tree = codec.decode_tree(request.tree, self.vocab_size, self.config.max_tree_nodes)
        first = self._next_draft_call(VerifyCall(seq_id, tree, request.round_index), request.next_draft, run=True)
        ahead = decode_run_ahead(request.ahead) if request.HasField("ahead") else None
        if ahead is not None and not first.drafter:
            raise InvalidRequest("ahead: drafting ahead inside a run needs the drafter in another process "
                                 "(next_draft.drafter); a verifier that drafts too drafts on its own model thread")
        if ahead is not None and first.next_params is None:
            raise InvalidRequest("ahead: drafting ahead inside a run needs next_draft.tree (the run's shape: each "
                                 "ahead tree is cut to it)")
        made = [0]  # tokens the run's rounds committed

        def follow(step: NextDraftVerify, answer: vpb.VerifyResponse | QueuedVerify) -> NextDraftVerify | None:
            queued = answer if isinstance(answer, QueuedVerify) else None  # a device round's: its tree on the device
            response: vpb.VerifyResponse = queued.verdict if queued is not None else answer
            new = [*response.tokens[1:], response.bonus]
            made[0] += len(new)
            if made[0] >= request.max_tokens or stop_ids.intersection(new) or (
                    queued is None and not response.HasField("next_tree")):
                return None
            if not response.round_index:  # a single Verify's answer, given again: its caller has left the run
                return None  # (a run computes a round only after a round of its own: the engine's shapes rule)
            tree = (queued.tree if queued is not None
                    else codec.decode_tree(response.next_tree, self.vocab_size, self.config.max_tree_nodes))
            if step.device and not isinstance(tree, TreeOnDevice):  # (a round drafted on the host)
                tree = tree_on_device(tree, self.device_rounds.device)  # type: ignore[union-attr]
            return replace(step, tree=tree, round_index=step.round_index + 1, next_round=step.next_round + 1)

        run = (self._direct_run(first, request.rounds, follow, context, ahead) if first.drafter
               else self._local_run(first, request.rounds, follow))
        async for answer in run:
            yield answer

    async def _local_run(self, first: NextDraftVerify, rounds: int, follow):
        """A run with this process's head: the model thread drafts each next tree and queues the next
        round itself (RunChain with `follow`); device rounds where the sequence can (device_round.py)."""
        if self.device_rounds is not None and self.device_rounds.takes(first.seq_id):
            first = replace(self.device_rounds.first(first), device=True)
        chain = RunChain(self.batcher, asyncio.get_running_loop(), first, rounds,
                         VERIFY_SECONDS.labels(SERVICE).observe, follow)
        chain.start()
        try:
            for _ in range(rounds):
                answer = await chain.next_answer()
                if answer is END:
                    break
                if isinstance(answer, BaseException):
                    raise answer
                yield answer
        finally:
            chain.cancel()  # the caller went away (or the run ended): queue no further round

    async def _direct_run(self, first: NextDraftVerify, rounds: int, follow, context,
                          ahead: RunAhead | None = None):
        """A run with the sequence's drafter in another process: each round's verdict drafted at the
        drafter (direct_draft.py, on this loop), the next round queued before the answer goes out; a
        round whose draft failed ends the run (the coordinator drafts). With `ahead`, each round's next
        tree is drafted ahead while the round is verified (ahead_run.py)."""
        step = first
        if self._direct is None:
            self._direct = DirectDrafts(self.config.service)
        drafting = (AheadRun(self._direct, first.seq_id, first.drafter, ahead, first.next_params, first.next_round,
                             self.vocab_size) if ahead is not None else None)
        pending = asyncio.ensure_future(self._verify(step))
        launched = drafting.launch(step.tree, self._draft_timeout(context)) if drafting is not None else None
        try:
            for k in range(rounds):
                response = await pending
                if response.HasField("next_tree"):  # (a round answered again from a run has it)
                    pass
                elif drafting is not None:
                    await drafting.settle(response, launched, self._draft_timeout(context))
                    outcome = ("ahead" if response.next_tree_ahead else "drafted" if response.HasField("next_tree")
                               else "failed")
                    metrics.DIRECT_DRAFTS.labels(SERVICE, outcome).inc()
                else:
                    await self._draft_direct(step, response, context)
                following = follow(step, response) if k + 1 < rounds else None
                if following is not None:
                    pending = asyncio.ensure_future(self._verify(following))
                    if drafting is not None:
                        launched = drafting.launch(following.tree, self._draft_timeout(context))
                yield response
                if following is None:
                    return
                step = following
        finally:
            if not pending.done():  # the caller went away: the round in progress still runs (and is kept)
                pending.cancel()
            if launched is not None and not launched.task.done():
                launched.task.cancel()  # (the coordinator's next Draft realigns the drafter's KV: first_row)

    @rpc_errors
    async def Decode(self, request: vpb.DecodeRequest, context) -> vpb.DecodeResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        token = codec.token_ids([request.token], self.vocab_size, "decode")[0]
        return await timed(VERIFY_SECONDS.labels(SERVICE),
                            self.batcher.call_async(DecodeCall(seq_id, token, request.round_index,
                                                               request.keep_features)))

    @rpc_errors
    async def DecodeRun(self, request: vpb.DecodeRunRequest, context):
        """`steps` plain steps from `round_index`, one answer each (verifier_svc/plain_run.py)."""
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        check_steps(request.steps)
        token = codec.token_ids([request.token], self.vocab_size, "decode")[0]
        queued = self.queue_runs and self.verifier.queues_runs(seq_id)
        chain = RunChain(self.batcher, asyncio.get_running_loop(),
                         RunStep(seq_id, token, request.round_index, request.keep_features, on_device=queued),
                         request.steps, VERIFY_SECONDS.labels(SERVICE).observe)
        chain.start()
        try:
            for _ in range(request.steps):
                answer = await chain.next_answer()
                if isinstance(answer, BaseException):
                    raise answer
                yield answer
        finally:
            chain.cancel()  # the caller went away (or the run failed): queue no further step

    @rpc_errors
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        return pb.ReleaseResponse(released=await self.batcher.exclusive_async(self._release, seq_id))

    @rpc_errors
    async def GetInfo(self, request: pb.InfoRequest, context) -> vpb.VerifierInfo:
        cfg = self.target.config
        info = vpb.VerifierInfo(target=self.target_path, dtype=codec.dtype_name(self.target.dtype),
                                vocab_size=cfg.vocab_size, max_context=self.max_context,
                                eos_token_ids=list(self.eos_token_ids), max_sequences=self.config.max_sequences,
                                num_sequences=self.num_sequences, max_prompt_tokens=self.config.max_prompt_tokens,
                                prefill_chunk=self.prefill_chunk)
        if self.verify_cost is not None:
            info.verify_cost.CopyFrom(codec.encode_cost(self.verify_cost))
        return info

    # ---- on the worker thread ------------------------------------------------------------------------

    def _run_batch(self, calls: list[Call]) -> list:
        """One forward for every call that needs one; replays, unknown sequences and full capacity
        answer alone. Returns a response (or an exception) per call, in order."""
        results: list = [None] * len(calls)
        todo: list[int] = []
        admitted = 0
        batch_rows: dict[str, int] = {}  # client -> KV rows the Prefills of this batch reserve
        for i, call in enumerate(calls):
            try:
                if isinstance(call, Slice):
                    if call.start > 0:
                        self._check(call.seq_id)
                        todo.append(i)
                        continue
                    call = call.whole  # the first slice checks what the whole call would
                if isinstance(call, (FirstChunk, NextChunk)):
                    replay = self._chunk_replay(call)
                    if replay is not None:
                        if isinstance(calls[i], Slice):  # never: a replay is not splittable
                            raise InvalidRequest(f"sequence {call.seq_id!r}: a repeated chunk cannot be sliced")
                        results[i] = replay
                        continue
                if isinstance(call, PrefillCall):
                    if call.seq_id in self._kind:
                        raise InvalidRequest(f"sequence {call.seq_id!r} already exists on this verifier")
                    if len(self._kind) + admitted >= self.config.max_sequences:
                        raise CapacityExceeded(f"verifier holds its maximum of {self.config.max_sequences} "
                                               f"sequences (AERIE_MAX_SEQUENCES)")
                    rebuild = self._was_preempted(call.seq_id)  # admitted under its share once: not held to it
                    if self._rebuilds_waiting and not rebuild:
                        raise KVBudgetExceeded(f"{len(self._rebuilds_waiting)} preempted sequence(s) wait for KV on "
                                               f"this verifier and go first")
                    client = self.shares.client_of(call.seq_id)
                    rows = self.verifier.first_rows(call)
                    if not rebuild:
                        self.shares.check(client, rows, batch_rows)
                    batch_rows[client] = batch_rows.get(client, 0) + rows
                    admitted += 1
                elif isinstance(call, PrefillMoreCall):
                    self._check(call.seq_id)
                else:
                    self._first.settled(call.seq_id)  # (its prefill will not be sent again)
                    replay = self._replay(call)
                    if replay is not None:
                        results[i] = replay
                        continue
            except Exception as e:  # noqa: BLE001 (this call's answer)
                results[i] = e
                continue
            todo.append(i)
        if not todo and self.device_rounds is not None:  # (replays only: answers owed are built now)
            for c in calls:
                self.device_rounds.settle(c.seq_id)
        if todo:
            run = [c.part() if isinstance(c, Slice) else c for c in (calls[i] for i in todo)]
            if self.device_rounds is not None:  # (a run's device rounds: the next draft queued from the verdict)
                run = [self.device_rounds.hooked(c, c.next_params, c.next_round)
                       if isinstance(c, NextDraftVerify) and c.device else c for c in run]
            drafts: list[tuple[int, VerifyResult]] = []
            try:
                outs = self.verifier.run(run)
            finally:
                if self.device_rounds is not None:  # answers still owed from the rounds before: built now
                    for c in calls:                  # (a round's hook built its sequence's already)
                        self.device_rounds.settle(c.seq_id)
            for i, out in zip(todo, outs):
                call = calls[i]
                if isinstance(call, Slice) and isinstance(out, BaseException) and call.start > 0:
                    self._release(call.seq_id)  # a prompt is never left partly prefilled by a failed slice
                results[i] = out if isinstance(out, BaseException) else self._respond(call, out)
                if isinstance(call, NextDraftVerify) and not call.drafter and isinstance(out, VerifyResult):
                    drafts.append((i, out))  # (a direct draft's runs on the event loop: Verify)
            if drafts:
                answers = self._draft_next([calls[i] for i, _ in drafts], [out for _, out in drafts],
                                           [results[i] for i, _ in drafts])
                for (i, _), answer in zip(drafts, answers, strict=True):
                    results[i] = answer
        return results

    def _draft_next(self, calls: list, outs: list[VerifyResult], responses: list[vpb.VerifyResponse]) -> list:
        """This batch's next drafts (the Verify calls that asked), in one batch of this process's head,
        right after the forward: for each, the Draft the coordinator would send after the verdict (the
        accepted tokens and the bonus, the features of the root and the accepted nodes), its tree added
        to the Verify's answer (the stored one too: a repeated Verify gets it again). None where Decode
        calls kept rows since the previous Verify (their tokens are the coordinator's to send) or the
        draft failed (a head that lost the sequence): the coordinator then drafts with a Draft call.
        A device round whose draft was queued from its verdict answers with a QueuedVerify instead
        (device_round.py; stored as the round's answer). Returns each call's answer."""
        answers: list = list(responses)
        for k, (c, o, r) in enumerate(zip(calls, outs, responses)):
            queued = self.device_rounds.answer(c.seq_id, c.next_round, o, r) if c.device and self.device_rounds else None
            if queued is not None:
                answers[k] = queued
                self._run_answers.keep(c.seq_id, c.round_index, queued)
                self._last[c.seq_id] = (c.round_index, queued)
        todo = [(c, o, r) for c, o, r, a in zip(calls, outs, responses, answers)
                if a is r and o.features.shape[0] == len(o.acceptance.new_tokens)]
        if not todo:
            return answers
        assert self.drafter_servicer is not None  # (Verify checked)
        t0 = time.perf_counter()
        drafted = self.drafter_servicer.draft_next(
            [(DraftCall(c.seq_id, torch.tensor(o.acceptance.new_tokens), o.features, c.next_params), c.next_round)
             for c, o, _ in todo])
        seconds = time.perf_counter() - t0
        for (c, o, response), d in zip(todo, drafted):
            if isinstance(d, BaseException):
                log.info("sequence %s: the next draft in Verify round %d failed (%s); its coordinator drafts "
                         "with a Draft call", c.seq_id, c.round_index, d)
                continue
            response.next_tree.CopyFrom(d.tree)
            response.next_draft_seconds = seconds
            response.drafter_busy = d.busy
            # the head took the features here: none travel (the coordinator has no rows to send now)
            response.features.CopyFrom(codec.encode_tensor(o.features[:0]))
        return answers

    def _splittable(self, call: Call) -> bool:
        """A prefill call may be sliced unless it is a chunk sent again (answered from its stored answer)."""
        if isinstance(call, (FirstChunk, NextChunk)):
            done = self._chunks.get(call.seq_id)
            return not (done is not None and done[0] == call.offset and done[1] == call.offset + call.rows)
        return True

    def _respond(self, call: Call, out):
        if isinstance(call, Slice):
            parts = self._slices.setdefault(call.seq_id, [])
            parts.append(out)
            if call.start == 0 and isinstance(call.whole, PrefillCall):
                self._admitted(call.whole)
            if call.stop < call.whole.rows:
                self._prefilling.add(call.seq_id)
                return out  # a slice's own answer: not seen by the caller
            del self._slices[call.seq_id]
            return self._respond(call.whole, merge_prefill(parts))
        if isinstance(call, (PrefillCall, PrefillMoreCall)):
            if out.first_token < 0:
                self._prefilling.add(call.seq_id)
            else:
                self._prefilling.discard(call.seq_id)
        if isinstance(call, (FirstChunk, NextChunk)):
            # the last chunk's answer (first_token >= 0) carries the first token's logprobs, kept
            # with it so that the chunk sent again gets them too
            logprobs = (codec.encode_logprobs(self.verifier.take_logprobs(call.seq_id))
                        if out.first_token >= 0 else None)
            answer = ChunkAnswer(out, logprobs)
            self._chunks[call.seq_id] = (call.offset, call.offset + call.rows, answer)
            if isinstance(call, FirstChunk):
                self._admitted(call)
            return answer
        if isinstance(call, PrefillMoreCall):
            return out
        if isinstance(call, PrefillCall):
            self._admitted(call)
            return out
        logprobs = codec.encode_logprobs(self.verifier.take_logprobs(call.seq_id))  # None unless asked for
        if isinstance(call, VerifyCall):
            response = codec.encode_verify_result(out)
            if logprobs is not None:
                response.logprobs.CopyFrom(logprobs)
            if isinstance(call, NextDraftVerify) and call.run:
                response.round_index = call.round_index
        elif isinstance(call, RunStep) and isinstance(out, torch.Tensor):  # a queued step: read off this thread
            round_index = call.round_index
            response = QueuedToken(out, lambda token: vpb.DecodeResponse(token=token, round_index=round_index))
        elif isinstance(call, RunStep):
            response = vpb.DecodeResponse(token=out, logprobs=logprobs, round_index=call.round_index)
        else:
            response = vpb.DecodeResponse(token=out, logprobs=logprobs)
        if isinstance(call, RunStep) or isinstance(call, NextDraftVerify) and call.run:
            self._run_answers.keep(call.seq_id, call.round_index, response)  # (a tree's: its next tree added later)
        else:
            self._run_answers.forget(call.seq_id)  # past its run
        self._chunks.pop(call.seq_id, None)  # the caller has the whole prefill's answer
        self._last[call.seq_id] = (call.round_index, response)
        return response

    def _admitted(self, call: PrefillCall) -> None:
        if call.seq_id in self._kind:  # its first slice admitted it
            return
        self._kind[call.seq_id] = call.feature_kind
        self.shares.hold(call.seq_id, self.verifier.reserved(call.seq_id))
        self.idle.touch(call.seq_id)
        SEQUENCES_IN_FLIGHT.labels(SERVICE).set(len(self._kind))

    def _release(self, seq_id: str) -> bool:
        kind = self._forget(seq_id)
        self.verifier.release(seq_id)
        return kind is not None

    def _preempted(self, seq_id: str) -> None:
        """The verifier preempted `seq_id` (its KV is released already): forget it here too."""
        self._forget(seq_id)
        metrics.NUM_PREEMPTIONS.labels(metrics.model_label(self.target_path)).inc()
        log.info("sequence %s preempted: its KV is released for older sequences to grow", seq_id)

    def _forget(self, seq_id: str):
        """Drop this servicer's state of `seq_id`; its feature kind (None: it held none)."""
        kind = self._kind.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self._run_answers.forget(seq_id)
        if self.device_rounds is not None:
            self.device_rounds.forget(seq_id)
        self._chunks.pop(seq_id, None)
        self._slices.pop(seq_id, None)
        self._prefilling.discard(seq_id)
        self._first.forget(seq_id)
        self.idle.forget(seq_id)
        self.shares.release(seq_id)
        SEQUENCES_IN_FLIGHT.labels(SERVICE).set(len(self._kind))
        return kind

    def _was_preempted(self, seq_id: str) -> bool:
        return isinstance(self.verifier.not_found(seq_id), SequencePreempted)

    def _check(self, seq_id: str) -> None:
        if seq_id not in self._kind:
            raise self.verifier.not_found(seq_id)
        self.idle.touch(seq_id)

    def _chunk_replay(self, call: ChunkCall) -> ChunkAnswer | None:
        """The stored answer when `call` is the latest chunk again (it ran after its caller's
        deadline); None when it is the next chunk to run; InvalidRequest for any other offset."""
        done = self._chunks.get(call.seq_id)
        if done is not None and done[0] == call.offset and done[1] == call.offset + call.rows:
            self.idle.touch(call.seq_id)
            return done[2]
        if isinstance(call, NextChunk):
            self._check(call.seq_id)
            if done is None or done[1] != call.offset:
                held = f"{done[1]} prefilled rows" if done is not None else "no prefill in progress"
                raise InvalidRequest(f"sequence {call.seq_id!r} holds {held} here; a chunk at offset "
                                     f"{call.offset} cannot follow")
        return None

    def _replay(self, call: VerifyCall | DecodeCall):
        """The stored response when the call's round is the latest round again, or a Decode at a round
        of the latest run (a retry after a broken run stream); None for a new round."""
        seq_id, round_index = call.seq_id, call.round_index
        self._check(seq_id)
        ran = self._run_answers.get(seq_id, round_index)
        if ran is not None:
            if isinstance(call, VerifyCall) != isinstance(ran, (vpb.VerifyResponse, QueuedVerify)):
                raise InvalidRequest(f"round {round_index} of sequence {seq_id!r} was a "
                                     f"{'plain step' if isinstance(call, VerifyCall) else 'tree round'} of a run here; "
                                     f"a {'Verify' if isinstance(call, VerifyCall) else 'Decode'} cannot repeat it")
            return _stored(call, ran)
        last = self._last.get(seq_id)
        if last is None or round_index > last[0]:
            return None
        if round_index == last[0]:
            return _stored(call, last[1])
        raise InvalidRequest(f"round {round_index} of sequence {seq_id!r} is older than its latest round {last[0]}")



def _split(call: Call, rows: int) -> tuple[Slice, Slice]:
    """(the first `rows` rows of a prefill call, the rest) as Slices (the batcher's `split`)."""
    whole = call if isinstance(call, Slice) else Slice(call, 0, call.rows)  # type: ignore[arg-type]
    return whole.split(rows)


def _client(context) -> str:
    """The identity a Prefill's KV counts against: the `aerie-client` metadata (verifiers are internal:
    only coordinators, holding the internal token or client certificate, call them), else ANONYMOUS."""
    for k, v in (context.invocation_metadata() if context is not None else None) or ():
        if k == CLIENT_METADATA:
            value = (v.decode() if isinstance(v, bytes) else v).strip()
            return value[:200] or ANONYMOUS
    return ANONYMOUS


def _stored(call: Call, answer: object) -> object:
    """A stored answer for a repeated call: a run step takes a QueuedAnswer as it is (its token is the
    next step's input); a Decode gets the response, read from the device once."""
    return answer.response() if isinstance(answer, QueuedAnswer) and not isinstance(call, RunStep) else answer


def _check_round(round_index: int) -> None:
    if round_index < 1:
        raise InvalidRequest(f"round_index must be >= 1 (0 is the prefill); got {round_index}")


def context_limit(model_context: int, max_model_len: int | None) -> int:
    """The tokens one sequence may span: --max-model-len, which may lower the model's context but
    never raise it (vLLM refuses the same at start), else the model's context."""
    if max_model_len is None:
        return model_context
    if max_model_len > model_context:
        raise ConfigError(f"--max-model-len {max_model_len} is larger than the model's context of {model_context} "
                          f"tokens (config.json); give at most {model_context}")
    return max_model_len


def kv_budget_rows(config: VerifierConfig, bytes_per_row: int, device: str,
                   memory: Callable[[str], tuple[int, int]] = device_memory) -> int | None:
    """The KV pool's rows budget: --kv-budget-mb, else on CUDA --gpu-memory-utilization F (F x the
    GPU's total memory, less what is in use now that the model is loaded: `memory(device)` ->
    (free, total) bytes), else --kv-budget-share of the device's free memory now, else None
    (unbounded: --kv-budget-share 0). On the CPU --gpu-memory-utilization has no effect (a warning)."""
    util = config.gpu_memory_utilization
    if util is not None and not is_gpu(device):
        log.warning("--gpu-memory-utilization %g has no effect on the CPU: the KV budget is --kv-budget-share of "
                    "the free memory (or --kv-budget-mb)", util)
    if config.kv_budget_mb is not None:
        budget = int(config.kv_budget_mb * 2 ** 20)
    elif util is not None and is_gpu(device):
        free, total = memory(device)
        budget = int(util * total) - (total - free)
        if budget < bytes_per_row:
            raise ConfigError(f"--gpu-memory-utilization {util:g} leaves no KV memory: {(total - free) / 2 ** 30:.1f} "
                              f"GiB of the GPU's {total / 2 ** 30:.1f} GiB are in use after loading the model, more "
                              f"than {util:g} of it; raise it or free the GPU")
    elif config.kv_budget_share > 0:
        budget = int(config.kv_budget_share * free_memory_bytes(device))
    else:
        return None
    log.info("KV budget %.0f MiB (%d rows of %d bytes)", budget / 2 ** 20, budget // bytes_per_row, bytes_per_row)
    return max(1, budget // bytes_per_row)
