"""One sequence's placement and its fail-over: the only place a sequence moves between replicas.

The engine's round loop drives `placement.verifier` and `placement.drafter`, which have the
methods of the engine's roles (`services.engine.roles`), so `Engine` runs unchanged. Behind them:

    call fails (UNAVAILABLE, deadline, cancelled by a stopping replica, or the replica lost the sequence)
      -> mark_failed(replica) in its pool (placement skips it whatever GetInfo said before)
      -> acquire another replica (verifier: wait up to `verifier_wait_s`; drafter: do not wait)
      -> rebuild(): the verifier re-runs prompt + committed[:-1] (its KV invariant: every committed
         token but the last, which is the next root); the token it samples is dropped, nothing new
         is committed. The drafter refills its KV from the features that prefill returns, paired
         with the tokens shifted by one (exactly what the engine's first draft sends).
      -> on_move(drafter, verifier) records the new placement in Redis
      -> the failed call is repeated with the same round index

A prefill or rebuild goes chunk by chunk (coordinator/prefill.py): each chunk has its own deadline, a
chunk that misses it is sent again to the same verifier (a slow replica is not moved away from) up
to `prefill_tries` times, then the sequence fails with DEADLINE_EXCEEDED; a fail-over during a
prefill starts it from row 0 on the new verifier. `stop` (set by the sequence's run) is checked
before every chunk: a cancel stops a prefill within one chunk.

Drafting ahead (AERIE_OVERLAP): `draft_ahead` runs on the engine's drafter thread while the main
thread's Verify is in flight, so it never moves the sequence itself (placement changes stay on the
main thread). A DraftAhead that fails over returns None (a miss) and leaves the failure for the next
`draft`, which marks the drafter failed, places another and refills it like any drafter fail-over;
the committed rows the ahead call could not deliver (no drafter placed, or its first draft not sent
yet) are kept and go in front of the next draft's rows. Either way the next round's tree is drafted
as without overlap: output stays the target's.

A detached drafter (plain steps: Decode with keep_features) leaves the features of those rows on the
verifier until the next Verify returns them. A verifier that fails meanwhile loses them; the rebuild's
own features hold the same rows, so the next Verify's answer gets them back in front (nothing lost).

A run of plain rounds (DecodeRun, `decode_run`): each token the engine reads from it is added to
`committed` as a Decode's would be; a run that breaks fails over like a Decode (the sequence is
rebuilt from `committed` on a replacement, or on the same verifier after a transient error) and the
rest of the run continues there as a new run from the next round. Tokens the broken run computed
but the engine had not read are not used (the rebuilt verifier computes the same ones again).

A run of tree rounds (VerifyRun, `verify_run`, on a verifier that drafts too): each round's answer
is added like a Verify's; where the run ended or broke, the round is a single Verify with the usual
fail-over (a broken run's rounds are answered again by the same verifier, or rebuilt elsewhere) and
the run stays closed.

Direct drafts (--direct-drafts, `UnreachedDrafters`): a Verify's next_draft names the sequence's
drafter in another process and the verifier sends it the Draft. An answer without a next tree leaves
the round's draft to the coordinator's own Draft call, as without direct drafts; when that call then
reaches the same drafter, the verifier could not (a firewall, a NetworkPolicy, another network): the
coordinator sends no direct draft to that drafter for `retry_s` (every sequence of this coordinator).

`committed` here is every token the verifier has produced (what Redis holds plus the round in
flight, which the engine commits next): the same list a coordinator taking a sequence over would
read from Redis. With no drafter available the drafter side returns a root-only tree: the verifier
then samples the next token from the target alone (a plain decoding round, lossless by construction)
and the next round tries to place a drafter again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import torch

from services import metrics
from services.engine.verifier import PrefillResult, VerifyResult
from services.errors import PREEMPTED, ROWS_MISSING
from services.rpc.clients import (NO_PHASES, DrafterClient, NextDraft, Phases, RemoteDrafter, RemoteVerifier,
                                  VerifierClient)
from services.rpc.errors import DownstreamError
from coordinator.prefill import ChunkedPrefill, PrefillTimedOut
from services.spec.overlap import RunAhead
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams, root_tree
from coordinator.placement import Pool

log = logging.getLogger("aerie.coordinator")
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def is_failover(e: BaseException) -> bool:
    """A failure that moves the sequence to another replica (anything else fails the sequence)."""
    return isinstance(e, DownstreamError) and e.code in FAILOVER_CODES and not isinstance(e, PrefillTimedOut)


def failover_reason(e: BaseException | None) -> str:
    """The `reason` label of aerie_failovers_total for the failure that moved a sequence."""
    if e is None:
        return "drafter_returned"
    if isinstance(e, DownstreamError) and e.lost_sequence:
        return "preempted" if PREEMPTED in str(e) else "not_found"
    if isinstance(e, DownstreamError) and e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline_exceeded"
    return "unavailable"


@dataclass(frozen=True, slots=True)
class Move:
    """One fail-over, for logs and tests."""
    role: str  # "verifier" | "drafter"
    old: str  # address ("" = none)
    new: str  # address ("" = none: plain decoding rounds until a drafter returns)
    reason: str
    rebuild_s: float  # re-prefill (and drafter refill) time
    rows: int  # rows re-prefilled


class UnreachedDrafters:
    """The coordinator's --direct-drafts: the drafters its verifiers could not reach lately (each
    for `retry_s` from then), shared by its sequences. Thread-safe."""

    def __init__(self, retry_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self.clock = clock
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def reachable(self, address: str) -> bool:
        with self._lock:
            until = self._until.get(address)
            if until is not None and self.clock() >= until:
                del self._until[address]
                until = None
            return until is None

    def unreached(self, address: str) -> None:
        with self._lock:
            if address not in self._until:
                log.warning("a verifier could not send drafter %s its Draft (direct drafts) where this coordinator "
                            "could: no direct drafts to it for %.0f s", address, self.retry_s)
            self._until[address] = self.clock() + self.retry_s


class SequencePlacement:
    def __init__(self, seq_id: str, verifiers: Pool[VerifierClient], drafters: Pool[DrafterClient] | None,
                 phases: Phases = NO_PHASES, verifier_wait_s: float = 30.0,
                 on_move: Callable[[str, str], None] | None = None, prefill_tries: int = 3,
                 kv_client: str = "", direct_drafts: UnreachedDrafters | None = None) -> None:
        """`kv_client`: who the sequence's verifier KV counts against (its shares). `prefill_tries`: calls per prefill chunk that misses its deadline before the sequence fails
        (AERIE_PREFILL_TRIES). `stop` (assign it; default: never) raises to stop a prefill between chunks."""
        self.seq_id = seq_id
        self.kv_client = kv_client
        self.direct_drafts = direct_drafts  # not None: verifiers draft at a drafter in another process too
        self._missed = ""  # the drafter a direct draft missed at last (the next Draft call tells why)
        self.prefill_tries = prefill_tries
        self.stop: Callable[[], None] = lambda: None
        self.verifiers = verifiers
        self.drafters = drafters
        self.phases = phases
        self.verifier_wait_s = verifier_wait_s
        self.on_move = on_move
        self.moves: list[Move] = []
        self._lock = threading.Lock()
        self.verifier_client: VerifierClient = verifiers.acquire(wait_s=verifier_wait_s)
        self.drafter_client: DrafterClient | None = None
        self._rd: RemoteDrafter | None = None
        try:
            if drafters is not None:  # the drafter in the verifier's own process first (verifier --draft)
                self.drafter_client = drafters.try_acquire(prefer=self.verifier_client.address)
                if self.drafter_client is not None:
                    self._rd = self.drafter_client.for_sequence(phases)
        except BaseException:
            self.close()
            raise
        # the tree shape the engine sizes the KV for; a replacement drafter must not need more
        self.tree: TreeParams = self._rd.tree if self._rd else TreeParams()
        # the verifier's features follow the drafter's kind; with a drafter pool but no drafter yet,
        # "hidden" (rounds verify root-only trees, whose answer carries features)
        self._kind = self._rd.feature_kind if self._rd else ("hidden" if drafters is not None else "none")
        self._rv = self.verifier_client.for_sequence(self._kind, phases, self.kv_client)
        # what a rebuild needs, recorded from the engine's own calls
        self.prompt: list[int] = []
        self.committed: list[int] = []  # every token the verifier produced, in order
        self._sampling = SamplingParams()
        self._capacity = 0
        self._draft_rows = 0
        self._draft_sampling = False
        self._drafter_started = False
        self._resume: tuple[list[int], list[int]] | None = None  # (prompt, committed) of a take-over
        self._restart = False  # a take-over of a sequence that never committed: its old KV may be here
        self._abandoned = False
        self._kept = 0  # rows the current verifier keeps for the next Verify (Decode keep_features)
        self._lost: torch.Tensor | None = None  # [k, F] kept rows a failed verifier took with it
        self._round = 0  # the engine's latest verify / decode round (main thread): draft spans' round
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # rows a DraftAhead did not deliver
        self._ahead_failed: DownstreamError | None = None  # a DraftAhead's fail-over, for the next draft
        # the next draft says where its rows go in the drafter's KV and is numbered past a call still in flight
        # (a run that drafted ahead was left early, or its DraftAhead failed: that call may still add rows)
        self._realign = False
        self.verifier = _VerifierSide(self)
        self.drafter = _DrafterSide(self) if drafters is not None else None

    # ---- the verifier side -------------------------------------------------------------------------

    def resume_from(self, prompt: list[int], committed: list[int]) -> None:
        """A take-over: the engine is given prompt + committed[:-1] as its prompt; its prefill becomes
        a rebuild whose first token is committed[-1] (its rounds are numbered from the sequence's
        next round: Engine.generate's round_base)."""
        self._resume = (list(prompt), list(committed))

    def restart(self, old_drafter: str = "", old_verifier: str = "") -> None:
        """A take-over of a sequence that died before its prefill commit: it starts over, and the
        replicas chosen now may hold the old coordinator's KV under the same id, so `prefill` releases
        it there first (then prefills afresh). Replicas it was placed on before and that were not
        chosen now release it in the background (else the idle TTL would)."""
        self._restart = True
        self.release_elsewhere(old_drafter, old_verifier)

    def release_elsewhere(self, old_drafter: str, old_verifier: str) -> None:
        """Best-effort release of this sequence on the replicas a previous coordinator used, when
        they are not the current ones (a take-over: never wait for them, they may be dead)."""
        drafter, verifier = self.addresses()
        for pool, old, now in ((self.verifiers, old_verifier, verifier), (self.drafters, old_drafter, drafter)):
            if pool is None or not old or old == now:
                continue
            client = next((c for c in pool.clients() if c.address == old), None)
            if client is not None:
                _release_later(client, self.seq_id)

    def abandon(self) -> None:
        """Another coordinator took the sequence over: release nothing (it may use the same replicas)."""
        self._abandoned = True

    def prefill(self, seq_id: str, prompt: torch.Tensor, sampling: SamplingParams, capacity: int,
                first_draft: TreeParams | None = None) -> PrefillResult:
        """`first_draft` (asked after `drafts_first`): round 1's tree of that shape drafted in the prefill
        where the verifier that runs it reaches the sequence's drafter (verifier_svc/first_draft.py;
        a fail-over to another verifier may not: the result then has no next_tree and the features)."""
        if self._resume is not None:
            (self.prompt, self.committed), self._resume = self._resume, None
            self._sampling, self._capacity = sampling, capacity
            # the previous coordinator's KV may still be there under the same id: drop it first
            if self._rd is not None:
                self.drafter_client.release(seq_id)
            pre = self._reprefill()
            return PrefillResult(self.committed[-1], pre.features)
        self.prompt, self._sampling, self._capacity = prompt.tolist(), sampling, capacity
        if self._restart:  # the previous coordinator's KV may still be here: drop it first
            self._rv.release(seq_id)
            if self._rd is not None:
                self.drafter_client.release(seq_id)
        sent: list[NextDraft | None] = [None]

        def next_draft(rv: RemoteVerifier) -> NextDraft | None:
            sent[0] = self._first_draft(rv, first_draft)  # asked whenever a verifier starts at row 0
            if sent[0] is not None:  # (a prefill stopped after its draft ran still leaves no draft KV behind)
                self._rd.prefilling_elsewhere(seq_id)  # type: ignore[union-attr]
            return sent[0]

        pre = self._prefill_chunks(ChunkedPrefill(seq_id, self.prompt, sampling, capacity, False,
                                                  self.prefill_tries, self._stop, next_draft))
        self._restart = False
        self.committed = [pre.first_token]
        if pre.next_tree is not None:
            self._rd.drafted_elsewhere(seq_id, sent[0].index, self._rv.busy)  # type: ignore[union-attr]
        elif sent[0] is not None and sent[0].drafter:
            self._missed = sent[0].drafter  # (the engine's Prefill to it says whether the verifier reaches it)
        return pre

    def drafts_first(self, seq_id: str) -> bool:
        """Round 1's tree can be drafted in the prefill (`prefill(first_draft=...)`): a new sequence (not a
        take-over's rebuild) whose drafter has no draft KV yet and is the verifier's own process, or any
        drafter with --direct-drafts."""
        return (self._resume is None and self._rd is not None and not self._rd.prefilled(seq_id)
                and self._first_draft(self._rv, TreeParams()) is not None)

    def _first_draft(self, rv: RemoteVerifier, params: TreeParams | None) -> NextDraft | None:
        """A Prefill's next_draft on `rv` (the drafter's Prefill index 1, the shape, the drafter's address
        unless it is `rv`'s own process), or None: not asked, or `rv` cannot reach the drafter."""
        if params is None or self._rd is None or self.drafter_client is None:
            return None
        address = self.drafter_client.address
        if address == rv.client.address:
            return NextDraft(1, params)
        if self.direct_drafts is not None and self.direct_drafts.reachable(address):
            return NextDraft(1, params, address)
        return None

    def verify(self, seq_id: str, tree: DraftTree, round_index: int, next_draft: TreeParams | None = None
               ) -> VerifyResult:
        """`next_draft`: the next tree's shape, drafted from the verdict in the same call when the
        sequence's drafter is its verifier's own process at that moment (`drafts_next`; a fail-over in
        between drops it: the result then has no next_tree and the engine drafts as usual)."""
        self._round = round_index
        sent: list[NextDraft | None] = [None]

        def verify(rv):
            sent[0] = self._next_draft(seq_id, next_draft)  # asked at each try
            return rv.verify(seq_id, tree, round_index, sent[0])

        res = self._on_verifier(verify)
        if res.next_tree is not None:
            self._rd.drafted_elsewhere(seq_id, self._rd.next_index(seq_id), self._rv.busy)  # type: ignore[union-attr]
        elif sent[0] is not None:
            self._missed = sent[0].drafter
        self.committed += res.acceptance.new_tokens
        self._kept = 0
        if self._lost is not None:  # rows a failed verifier kept: in front, as it would have sent them
            if res.features.shape[0]:
                res = replace(res, features=torch.cat([self._lost.to(res.features.dtype), res.features]))
            self._lost = None
        return res

    def drafts_next(self, seq_id: str) -> bool:
        """The sequence's drafter is its verifier's own process (a verifier started with --draft), or
        any drafter with --direct-drafts, and holds its draft KV, with no rows waiting elsewhere: a
        Verify can draft the next tree too."""
        return (self._rd is not None and self.drafter_client is not None and self.verifier_client is not None
                and (self.drafter_client.address == self.verifier_client.address or self.direct_drafts is not None
                     and self.direct_drafts.reachable(self.drafter_client.address))
                and self._rd.prefilled(seq_id) and not self._held and self._ahead_failed is None and not self._kept
                and not self._realign
                and self._lost is None)

    def _next_draft(self, seq_id: str, params: TreeParams | None) -> NextDraft | None:
        """The Verify's next_draft (the drafter's next index, the shape, the drafter's address unless
        it is the verifier's own process), asked at each try: None unless the engine asked and the
        verifier can (still) draft it."""
        if params is None or not self.drafts_next(seq_id):
            return None
        address = self.drafter_client.address  # type: ignore[union-attr]
        return NextDraft(self._rd.next_index(seq_id), params,  # type: ignore[union-attr]
                         "" if address == self.verifier_client.address else address)

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int:
        self._round = round_index
        out = self._on_verifier(lambda rv: rv.decode(seq_id, token, round_index, keep_features))
        self.committed.append(out)
        if keep_features:
            self._kept += 1
        return out

    def decode_run(self, seq_id: str, token: int, round_index: int, steps: int,
                   keep_features: bool = False) -> _PlacedRun:
        """A run of `steps` plain rounds (RemoteVerifier.decode_run) with fail-over (module doc)."""
        return _PlacedRun(self, seq_id, token, round_index, steps, keep_features)

    def verify_run(self, seq_id: str, tree: DraftTree, round_index: int, next_draft: TreeParams, rounds: int,
                   max_tokens: int, stop_ids: frozenset[int], ahead: RunAhead | None = None) -> _PlacedTreeRun | None:
        """A run of up to `rounds` tree rounds on the verifier that drafts too (RemoteVerifier.verify_run),
        read round by round with fail-over (module doc); None when the sequence's drafter is not its
        verifier's process now (`drafts_next`). `ahead`: drafting ahead in its rounds (`runs_ahead`)."""
        nxt = self._next_draft(seq_id, next_draft)
        if nxt is None or ahead is not None and not nxt.drafter:
            return None
        return _PlacedTreeRun(self, seq_id, self._rv.verify_run(seq_id, tree, round_index, nxt, rounds, max_tokens,
                                                                stop_ids, ahead))

    def runs_ahead(self, seq_id: str) -> bool:
        """A run of tree rounds can draft ahead at the verifier (VerifyRun with `ahead`): direct drafts to
        a drafter in another process, with target features (verifier_svc/ahead_run.py)."""
        return (self.drafts_next(seq_id) and self._kind != "none"
                and self.drafter_client.address != self.verifier_client.address)  # type: ignore[union-attr]

    def take_logprobs(self, seq_id: str):
        """The current verifier's log-probabilities of the latest call's tokens (RemoteVerifier)."""
        return self._rv.take_logprobs(seq_id)

    def _on_verifier(self, call):
        while True:
            try:
                return call(self._rv)
            except Exception as e:  # noqa: BLE001 - is_failover decides
                self._verifier_failed(e)
                pre = self._reprefill()
                if self._kept:
                    # the kept rows are the last rows rebuilt: prompt + committed[:-1] ends with the
                    # tokens those Decode calls fed
                    lost = pre.features[-self._kept:]
                    self._lost = lost if self._lost is None else torch.cat([self._lost, lost])
                    self._kept = 0

    def _stop(self) -> None:
        self.stop()

    def _prefill_chunks(self, job: ChunkedPrefill) -> PrefillResult:
        """Run `job` on the current verifier; after a fail-over, from row 0 on the new one (its copy
        of the sequence, if any, released first: the new verifier may be the same replica)."""
        while True:
            try:
                return job.run(self._rv)
            except Exception as e:  # noqa: BLE001 - is_failover decides
                self._verifier_failed(e)
                self._rv.release(self.seq_id)
                job.restart()

    def _verifier_failed(self, e: Exception) -> None:
        """Mark the verifier failed and acquire another (waiting up to verifier_wait_s), or raise."""
        if not is_failover(e):
            raise e
        old = self.verifier_client
        if not e.lost_sequence:  # (a replica that lost the sequence holds nothing to release)
            self.verifiers.mark_failed(old.address, str(e))
        self.verifiers.release(old)
        try:
            self.verifier_client = self.verifiers.acquire(wait_s=self.verifier_wait_s)
        except DownstreamError as none:
            self.verifier_client = None  # type: ignore[assignment]
            if not e.lost_sequence:
                _release_later(old, self.seq_id)
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"sequence {self.seq_id!r} lost its verifier ({e}) and {none}") from None
        if not e.lost_sequence and self.verifier_client.address != old.address:
            _release_later(old, self.seq_id)  # (the same replica again: the rebuild releases it in line)
        self._rv = self.verifier_client.for_sequence(self._kind, self.phases, self.kv_client)
        self._moved(Move("verifier", old.address, self.verifier_client.address, str(e), 0.0, 0), failover_reason(e))

    def _reprefill(self) -> PrefillResult:
        """Rebuild the verifier KV for prompt + committed[:-1] (on the current verifier, which may be
        the same one: its old KV is released first). The sampled token is dropped: committed[-1] is
        already the next root. Returns the features of those rows (for a drafter refill)."""
        rows = self.prompt + self.committed[:-1]
        t0 = time.perf_counter()
        self._rv.release(self.seq_id)
        pre = self._prefill_chunks(ChunkedPrefill(self.seq_id, rows, self._sampling, self._capacity, True,
                                                  self.prefill_tries, self._stop))
        if self.moves and self.moves[-1].role == "verifier" and self.moves[-1].rows == 0:
            m = self.moves[-1]
            self.moves[-1] = Move(m.role, m.old, m.new, m.reason, time.perf_counter() - t0, len(rows))
        log.info("sequence %s: verifier %s rebuilt %d rows in %.3f s", self.seq_id,
                 self.verifier_client.address, len(rows), time.perf_counter() - t0)
        self._event("rebuild", {"aerie.role": "verifier", "aerie.rows": len(rows),
                                "aerie.seconds": time.perf_counter() - t0})
        return pre

    # ---- the drafter side --------------------------------------------------------------------------

    def start(self, seq_id: str, max_rows: int, sampling: bool) -> None:
        self._draft_rows, self._draft_sampling = max_rows, sampling
        self._drafter_started = True
        if self._rd is not None:
            self._rd.start(seq_id, max_rows, sampling)

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None) -> DraftTree:
        """tokens [n] the newly committed tokens shifted by one (last = root); features [n, F];
        params: this round's shape from the budget (None = the drafter's largest)."""
        if self._held:  # rows a DraftAhead did not deliver go first
            tokens = torch.cat([t for t, _ in self._held] + [tokens])
            features = torch.cat([f.to(features.dtype) for _, f in self._held if f.numel()] + [features])
            self._held = []
        failed, self._ahead_failed = self._ahead_failed, None
        realign, self._realign = self._realign, False
        first_row = None
        if realign and failed is None and self._rd is not None:
            # a run that drafted ahead failed or was left early: a DraftAhead the verifier sent (one index past
            # the last answered) may have added some of these rows, or may still arrive. Number this call past
            # it (the drafter then refuses it) and say where its rows go (the drafter drops any it added)
            self._rd.skip_index(seq_id)
            first_row = len(self.prompt) + len(self.committed) - 1 - len(tokens)
            self._event("realign", {"aerie.role": "drafter", "aerie.first_row": first_row, "aerie.rows": len(tokens)})
        if failed is not None and self._rd is not None:
            if not self._drafter_failed(failed):
                return root_tree(self.committed[-1])  # degraded: a plain decoding round
            tokens, features = self._refill(tokens, features)
        if self._rd is None:
            if not self._place_drafter(""):
                return root_tree(self.committed[-1])  # still no drafter: a plain decoding round
            tokens, features = self._refill(tokens, features)
        while True:
            try:
                tree = self._rd.draft(seq_id, tokens, features, params, self._round + 1, first_row)
                if self._missed and self._missed == self.drafter_client.address and self.direct_drafts is not None:
                    self.direct_drafts.unreached(self._missed)  # it answers here, not to the verifier
                self._missed = ""
                return tree
            except Exception as e:  # noqa: BLE001 - is_failover decides
                if not is_failover(e):
                    raise
                if first_row is not None and isinstance(e, DownstreamError) and ROWS_MISSING in str(e):
                    # the KV lacks rows counted as taken: rebuild it on the same drafter, past any call in flight
                    log.warning("sequence %s: %s; rebuilding its draft KV", seq_id, e)
                    tokens, features = self._refill(tokens, features, first_index=self._rd.next_index(seq_id) + 1)
                elif not self._drafter_failed(e):
                    return root_tree(self.committed[-1])  # degraded: a plain decoding round
                else:
                    tokens, features = self._refill(tokens, features)
                first_row = None  # (a refill's Prefill sends every row)

    def draft_ahead(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor, guess: list[int],
                    params: TreeParams | None = None, round_index: int | None = None, branches: int | None = None,
                    exclude: tuple[tuple[int, ...], ...] = (), chain: tuple[int, ...] = ()) -> DraftTree | None:
        """The ahead tree (RemoteDrafter.draft_ahead) or None: no drafter, its first draft not sent,
        the guess does not fit, the call failed over (see the module doc), or the next draft realigns the
        drafter's KV (a run that drafted ahead was left: its DraftAhead may be in flight at the index this
        call would take). On the drafter thread."""
        rd = self._rd
        if rd is None or not rd.prefilled(seq_id) or self._realign:
            if tokens.numel():
                self._held.append((tokens, features))
            return None
        try:
            return rd.draft_ahead(seq_id, tokens, features, guess, params, round_index, branches, exclude, chain)
        except Exception as e:  # noqa: BLE001 - is_failover decides
            if not is_failover(e):
                raise
            self._ahead_failed = e  # the next draft moves the sequence (main thread)
            if tokens.numel():
                self._held.append((tokens, features))
            return None

    def _drafter_failed(self, e: DownstreamError) -> bool:
        """A drafter call failed over: mark the drafter failed (unless it only lost the sequence) and
        place another; True when one was placed (the caller refills it)."""
        if not e.lost_sequence:
            self.drafters.mark_failed(self.drafter_client.address, str(e))
        return self._place_drafter(str(e), release_old=not e.lost_sequence, label=failover_reason(e))

    def _place_drafter(self, reason: str, release_old: bool = True, label: str = "") -> bool:
        """Leave the current drafter (if any) and try another (not the one that just failed); True
        when one was placed. The verifier's feature kind follows the drafter's."""
        old = self.drafter_client
        if old is not None:
            self.drafters.release(old)
            if release_old:
                _release_later(old, self.seq_id)
        self.drafter_client, self._rd = None, None
        client = self.drafters.try_acquire([old.address] if old is not None else [],
                                           prefer=self.verifier_client.address if self.verifier_client else "")
        if client is not None:
            rd = client.for_sequence(self.phases)
            if rd.tree.size > self.tree.size:
                log.warning("drafter %s grows %d-node trees; sequence %s was sized for %d", client.address,
                            rd.tree.size, self.seq_id, self.tree.size)
                self.drafters.release(client)
                client = None
            else:
                self.drafter_client, self._rd = client, rd
        if old is not None or client is not None:
            self._moved(Move("drafter", old.address if old else "", client.address if client else "",
                             reason or "a drafter is available again", 0.0, 0), label or failover_reason(None))
        return client is not None

    def _refill(self, tokens: torch.Tensor, features: torch.Tensor, first_index: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start the newly placed drafter and return what its first draft sends: every committed row
        (tokens shifted by one) with the verifier's features for them. The caller's features already
        cover every row only at the first draft after the prefill, with the same feature kind.
        `first_index` > 1: a rebuild at the same drafter (no move), its Prefill numbered there."""
        move = len(self.moves) - 1 if first_index == 1 else None
        t0 = time.perf_counter()
        full = self.prompt + self.committed
        if self._rd.feature_kind != self._kind or len(tokens) != len(full) - 1:
            self._kind = self._rd.feature_kind
            self._rv = self.verifier_client.for_sequence(self._kind, self.phases, self.kv_client)
            features = self._reprefill().features
            tokens = torch.tensor(full[1:], dtype=torch.long)
        # a replica that was only unreachable (or a restart racing our old release) may still hold
        # the sequence's draft KV under this id: drop it first
        self.drafter_client.release(self.seq_id)
        self._rd.start(self.seq_id, self._draft_rows, self._draft_sampling, first_index)
        if move is not None:
            m = self.moves[move]
            self.moves[move] = Move(m.role, m.old, m.new, m.reason, time.perf_counter() - t0, len(tokens))
        self._event("rebuild", {"aerie.role": "drafter", "aerie.rows": len(tokens),
                                "aerie.seconds": time.perf_counter() - t0})
        return tokens, features

    # ---- both ----------------------------------------------------------------------------------------

    def release(self) -> None:
        """Free the KV on both replicas and their pool slots (the engine's `finally`)."""
        with self._lock:
            if self._abandoned:
                if self.verifier_client is not None:
                    self.verifiers.release(self.verifier_client)
                if self.drafter_client is not None:
                    self.drafters.release(self.drafter_client)
                self.verifier_client, self.drafter_client, self._rd = None, None, None  # type: ignore[assignment]
                return
            if self.verifier_client is not None:
                if self.prompt:  # prefilled (or tried to)
                    self._rv.release(self.seq_id)
                self.verifiers.release(self.verifier_client)
                self.verifier_client = None  # type: ignore[assignment]
            if self.drafter_client is not None:
                self._rd.release(self.seq_id)
                self.drafters.release(self.drafter_client)
                self.drafter_client, self._rd = None, None

    close = release

    def addresses(self) -> tuple[str, str]:
        """(drafter, verifier) now; "" for none."""
        return (self.drafter_client.address if self.drafter_client else "",
                self.verifier_client.address if self.verifier_client else "")

    def _moved(self, move: Move, reason: str) -> None:
        """Keep, count (aerie_failovers_total{role, reason}), log and trace one move; record it in Redis."""
        self.moves.append(move)
        metrics.FAILOVERS.labels("coordinator", move.role, reason).inc()
        log.warning("sequence %s: %s moved %s -> %s (%s: %s)", self.seq_id, move.role, move.old or "none",
                    move.new or "none (plain rounds)", reason, move.reason)
        self._event("failover", {"aerie.role": move.role, "aerie.from": move.old, "aerie.to": move.new,
                                 "aerie.reason": reason})
        self._record()

    def _event(self, name: str, attributes: dict) -> None:
        event = getattr(self.phases, "event", None)  # RoundSpans (tracing); NO_PHASES has none
        if event is not None:
            event(name, attributes)

    def _record(self) -> None:
        if self.on_move is not None:
            drafter, verifier = self.addresses()
            try:
                self.on_move(drafter, verifier)
            except Exception as e:  # noqa: BLE001 - the placement record is informational
                log.warning("cannot record the placement of %s: %s", self.seq_id, e)


def _release_later(client, seq_id: str) -> None:
    """Best-effort release on a replica we left (it may be dead or hung: never wait for it)."""
    threading.Thread(target=client.release, args=(seq_id,), name="release-old", daemon=True).start()


class _PlacedRun:
    """A run over the sequence's placement: its tokens, one per round (services.engine.engine.PlainRun)."""

    def __init__(self, p: SequencePlacement, seq_id: str, token: int, round_index: int, steps: int,
                 keep_features: bool) -> None:
        self.p = p
        self.seq_id = seq_id
        self.keep_features = keep_features
        self.round_index = round_index  # the round of the next token
        self.left = steps  # tokens not read yet
        self._run = None  # the current verifier's run (a RemoteVerifier PlainRun)

    def __iter__(self) -> _PlacedRun:
        return self

    def __next__(self) -> int:
        if self.left <= 0:
            raise StopIteration
        p = self.p
        p._round = self.round_index
        token = p._on_verifier(self._read)
        p.committed.append(token)
        if self.keep_features:
            p._kept += 1
        self.round_index += 1
        self.left -= 1
        return token

    def _read(self, rv) -> int:
        """The next token from the current verifier; a run that broke is started again there (after
        the fail-over's rebuild) for the rounds still to come."""
        if self._run is None:
            # committed[-1]: the engine's root (`token`) for the first run, the latest token read for a restart
            self._run = rv.decode_run(self.seq_id, self.p.committed[-1], self.round_index, self.left,
                                      self.keep_features)
        try:
            return next(self._run)
        except BaseException:
            self._run.close()
            self._run = None
            raise

    def close(self) -> None:
        self.left = 0
        if self._run is not None:
            self._run.close()
            self._run = None


class _PlacedTreeRun:
    """A run of tree rounds over the sequence's placement (services.engine.engine: the engine's tree
    runs). `next` gives each round's VerifyResult; where the run ended or broke, the round is one
    Verify call instead, with the placement's fail-over, and the run stays closed."""

    def __init__(self, p: SequencePlacement, seq_id: str, run) -> None:
        self.p = p
        self.seq_id = seq_id
        self._run = run  # the current verifier's TreeRun (None: ended or broken)

    def next(self, tree: DraftTree, round_index: int, next_draft: TreeParams | None) -> VerifyResult:
        p, run = self.p, self._run
        res = None
        if run is not None:
            try:
                res = run.next(round_index)
            except Exception as e:  # noqa: BLE001 - is_failover decides
                self.close()
                if not is_failover(e):
                    raise
        if res is None:  # the run ended or broke: this round alone (a broken run's rounds are answered again)
            self.close()
            return p.verify(self.seq_id, tree, round_index, next_draft)
        p._round = round_index
        if res.next_tree is not None or res.pending_rows:  # (next_index follows the run's draft_index)
            p._rd.drafted_elsewhere(self.seq_id, run.next_index - 1, p._rv.busy)  # type: ignore[union-attr]
        if res.ahead_failed:  # the failed call may still add its rows: the next draft realigns the drafter's KV
            p._realign = True
        elif res.next_tree is None:
            p._missed = run.drafter
        p.committed += res.acceptance.new_tokens
        p._kept = 0
        return res

    @property
    def open(self) -> bool:
        return self._run is not None

    @property
    def exhausted(self) -> bool:
        """The run gave every round it asked for: the next round starts another run (not a single Verify)."""
        return self._run is not None and self._run.exhausted

    def close(self) -> None:
        if self._run is not None:
            if self._run.ahead is not None and not self._run.finished:
                # left early: a DraftAhead the verifier sent for the next round may still reach the drafter
                # (its index, its rows): the next draft realigns the drafter's KV (`draft`, first_row)
                self.p._realign = True
            self._run.close()
            self._run = None


class _VerifierSide:
    """The verifier role for `Engine` (services.engine.roles.VerifierRole)."""

    def __init__(self, p: SequencePlacement) -> None:
        self._p = p

    def prefill(self, seq_id, prompt, sampling, capacity, first_draft=None):
        return self._p.prefill(seq_id, prompt, sampling, capacity, first_draft)

    def drafts_first(self, seq_id):
        return self._p.drafts_first(seq_id)

    def verify(self, seq_id, tree, round_index, next_draft=None):
        return self._p.verify(seq_id, tree, round_index, next_draft)

    def drafts_next(self, seq_id):
        return self._p.drafts_next(seq_id)

    def verify_run(self, seq_id, tree, round_index, next_draft, rounds, max_tokens, stop_ids, ahead=None):
        return self._p.verify_run(seq_id, tree, round_index, next_draft, rounds, max_tokens, stop_ids, ahead)

    def runs_ahead(self, seq_id):
        return self._p.runs_ahead(seq_id)

    def decode(self, seq_id, token, round_index, keep_features=False):
        return self._p.decode(seq_id, token, round_index, keep_features)

    def decode_run(self, seq_id, token, round_index, steps, keep_features=False):
        return self._p.decode_run(seq_id, token, round_index, steps, keep_features)

    def take_logprobs(self, seq_id):
        return self._p.take_logprobs(seq_id)

    def release(self, seq_id):
        self._p.release()


class _DrafterSide:
    """The drafter role for `Engine` (services.engine.roles.DrafterRole)."""

    def __init__(self, p: SequencePlacement) -> None:
        self._p = p

    @property
    def tree(self) -> TreeParams:
        return self._p.tree

    @property
    def feature_kind(self) -> str:
        return self._p._kind

    def start(self, seq_id, max_rows, sampling):
        self._p.start(seq_id, max_rows, sampling)

    def draft(self, seq_id, tokens, features, params=None):
        return self._p.draft(seq_id, tokens, features, params)

    def draft_ahead(self, seq_id, tokens, features, guess, params=None, round_index=None, branches=None, exclude=(),
                    chain=()):
        return self._p.draft_ahead(seq_id, tokens, features, guess, params, round_index, branches, exclude, chain)

    @property
    def busy(self) -> float:
        """The placed drafter's load in its latest answer (0 with none placed)."""
        rd = self._p._rd
        return rd.busy if rd is not None else 0.0

    @property
    def sharing(self) -> int:
        """This coordinator's sequences on the placed drafter (1 with none placed): the overlap policy's
        `sharing` (their ahead drafts run one at a time there, not batched like their drafts)."""
        p = self._p
        if p.drafter_client is None:
            return 1
        return max(1, p.drafters.loads().get(p.drafter_client.address, 1))

    def release(self, seq_id):
        self._p.release()
