"""One sequence, driven on its own thread: `Engine.generate` over the remote drafter and verifier,
each round committed to Redis before it is handed to the stream.

    for output in engine.generate(request):    # prefill, then draft -> verify rounds
        commit(output)                         # Redis, atomic, keyed by round index
        emit(output)                           # to the Generate stream
        stop on finish | cancel | error        # then both services release the KV

A cancel (the Cancel RPC through any coordinator, or the client going away) takes effect after the
round in flight is committed: the last message carries finish_reason "cancel". During a prefill
(or a fail-over rebuild) it takes effect before the next chunk (`check_stop`, coordinator/prefill.py):
the sequence ends cancelled with the tokens it committed (none, for a first prefill). A hand-over (a
draining coordinator, on SIGTERM) also takes effect after the round in flight is committed and
streamed: the run releases the KV on both services, lets its lease go (another coordinator claims the
sequence at its next scan) and hands the stream `HandedOver`, which tells the client to Resume. An error marks the
sequence failed in Redis and is handed to the stream, which maps it to a status code; it never
touches other sequences' records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from services import metrics
from services.engine.engine import Engine, GenerationRequest, RoundOutput, RoundStats
from coordinator.prefill import PrefillStopped
from coordinator.round_spans import RoundSpans
from coordinator.sequence_store import LeaseLost, SequenceStore
from coordinator.stored_logprobs import to_rows
from services.rpc.errors import DownstreamError
from services.spec.load_board import LoadBoard

log = logging.getLogger("aerie.coordinator")
SERVICE = "coordinator"


class HandedOver(Exception):
    """The run stopped after a committed and streamed round and let its lease go (this coordinator
    is draining): the sequence continues on another coordinator, where the client Resumes it."""


@dataclass(frozen=True, slots=True)
class Committed:
    """One committed round, as streamed."""
    output: RoundOutput  # finish_reason "cancel" when a cancel stopped the sequence after this round
    commit_s: float


class SequenceRun:
    def __init__(self, seq_id: str, request: GenerationRequest, engine: Engine, store: SequenceStore,
                 spans: RoundSpans, emit: Callable[[Committed | BaseException], None],
                 on_exit: Callable[[SequenceRun], None], owner: str = "", round_base: int | None = None,
                 on_lease_lost: Callable[[], None] | None = None) -> None:
        """`owner`: this coordinator's id (commits are fenced by the sequence's lease). `round_base`
        (None for a new sequence): for a sequence taken over from another coordinator, its last committed round; the engine
        then runs from a rebuilt state, numbering its rounds from round_base + 1 (Engine.generate); its
        round 0, the token already committed, is skipped)."""
        self.seq_id = seq_id
        self.request = request
        self.engine = engine
        self.store = store
        self.spans = spans
        self.emit = emit
        self.on_exit = on_exit
        self.owner = owner
        self.round_base = round_base
        self.on_lease_lost = on_lease_lost  # keep the KV: the new owner may use the same replicas
        self.cancelled = threading.Event()
        self.handing_over = threading.Event()
        self.handed_over = False  # the lease was let go (another coordinator may drive it now)
        self.thread = threading.Thread(target=self._run, name=f"seq-{seq_id[:12]}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def cancel(self) -> None:
        """Stop after the round in flight (thread-safe)."""
        self.cancelled.set()

    def hand_over(self) -> None:
        """Stop after the round in flight and let the lease go (thread-safe; see the module doc)."""
        self.handing_over.set()

    def check_stop(self) -> None:
        """Before each prefill chunk (on the run's thread): PrefillStopped when a cancel (here, or
        flagged in Redis by another coordinator) or a hand-over is pending."""
        cancel = self.cancelled.is_set()
        if not cancel:
            try:
                cancel = self.store.cancel_requested(self.seq_id)
            except Exception as e:  # noqa: BLE001 - Redis down: the commit path reports it
                log.debug("sequence %s: cannot read its cancel flag: %s", self.seq_id, e)
        if cancel:
            raise PrefillStopped("cancel", f"sequence {self.seq_id!r} was cancelled during its prefill")
        if self.handing_over.is_set():
            raise PrefillStopped("hand-over", f"sequence {self.seq_id!r} is handed over during its prefill")

    def _run(self) -> None:
        outputs = self.engine.generate(self.request, self.seq_id, self.round_base or 0)
        try:
            for output in outputs:
                if self.round_base is not None and output.stats.round_index == 0:
                    continue  # a take-over: the rebuilt state's first token is committed already
                t0 = time.perf_counter()
                with self.spans.phase(output.stats.round_index, "commit"):
                    result = self.store.commit(self.seq_id, output.stats.round_index, output.tokens, output.finish_reason,
                                               self.owner, to_rows(output.logprobs) if output.logprobs else None)
                commit_s = time.perf_counter() - t0
                self.spans.end_round(output.stats, commit_s)
                _observe(output, commit_s)
                _observe_board(self.engine.budget.load)
                if output.finish_reason is None and (result.cancel_requested or self.cancelled.is_set()):
                    self.store.finish(self.seq_id, "cancelled", "cancel")
                    output = replace(output, finish_reason="cancel")
                self.emit(Committed(output, commit_s))
                if output.finish_reason is not None:
                    return
                if self.handing_over.is_set():
                    outputs.close()  # releases the KV first: the new owner may pick the same replicas
                    self.handed_over = self.store.hand_over(self.seq_id, self.owner)
                    log.info("sequence %s handed over after round %d", self.seq_id, output.stats.round_index)
                    self.emit(HandedOver(f"sequence {self.seq_id!r} was handed over after round {output.stats.round_index}"))
                    return
        except PrefillStopped as e:
            self._stopped_in_prefill(outputs, e)
        except LeaseLost as e:  # another coordinator drives it now: leave Redis alone
            log.warning("sequence %s: %s; stopping here", self.seq_id, e)
            if self.on_lease_lost is not None:
                self.on_lease_lost()
            self.emit(DownstreamError(grpc.StatusCode.UNAVAILABLE,
                                      f"sequence {self.seq_id!r} moved to another coordinator: Resume it there ({e})"))
        except Exception as e:  # noqa: BLE001 - the sequence fails alone; the stream maps the error
            log.info("sequence %s failed: %s: %s", self.seq_id, type(e).__name__, e)
            try:
                self.store.finish(self.seq_id, "failed", "error", f"{type(e).__name__}: {e}")
            except Exception as store_error:  # noqa: BLE001
                log.warning("cannot mark %s failed in Redis: %s", self.seq_id, store_error)
            self.emit(e)
        finally:
            outputs.close()  # Engine.generate's finally releases the KV on both services
            self.spans.close()
            self.on_exit(self)

    def _stopped_in_prefill(self, outputs, e: PrefillStopped) -> None:
        """A cancel or hand-over that came during a prefill (or a rebuild): release the KV on both
        services first, then end the sequence cancelled (a last message with no tokens and
        finish_reason "cancel") or let its lease go (HandedOver)."""
        outputs.close()
        log.info("sequence %s: %s", self.seq_id, e)
        try:
            if e.reason == "hand-over":
                self.handed_over = self.store.hand_over(self.seq_id, self.owner)
                self.emit(HandedOver(str(e)))
                return
            self.store.finish(self.seq_id, "cancelled", "cancel")
        except Exception as store_error:  # noqa: BLE001 - Redis down: the stream gets the error
            log.warning("sequence %s: cannot record the stop in Redis: %s", self.seq_id, store_error)
            self.emit(store_error)
            return
        none = RoundStats(round_index=0, accept_length=0, tree_size=0, tree_max_depth=0, draft_s=0.0, verify_s=0.0)
        self.emit(Committed(RoundOutput([], none, "cancel"), 0.0))


def _observe_board(board: LoadBoard | None) -> None:
    """The budget's measured extras (its verifier's load board) as gauges, after each round."""
    if board is not None:
        for kind, seconds in board.extras().items():
            metrics.BUDGET_EXTRA_SECONDS.labels(SERVICE, board.name, kind).set(seconds)


def _observe(output: RoundOutput, commit_s: float) -> None:
    s = output.stats
    metrics.COMMIT_SECONDS.labels(SERVICE).observe(commit_s)
    metrics.TOKENS_GENERATED.labels(SERVICE).inc(len(output.tokens))
    if s.round_index == 0:
        metrics.PREFILL_SECONDS.labels(SERVICE).observe(s.verify_s)
        return
    metrics.ROUND_SECONDS.labels(SERVICE).observe(s.draft_s + s.verify_s + commit_s)
    metrics.ACCEPT_LENGTH.labels(SERVICE).observe(s.accept_length)
    metrics.TREE_SIZE.labels(SERVICE).observe(max(s.tree_size, 1))  # the budget's choice (1 = plain)
    metrics.BUDGET_NODES.labels(SERVICE).observe(max(s.tree_size, 1))  # (deprecated name, one release)
    if s.detached:
        metrics.DETACHED_ROUNDS.labels(SERVICE).inc()
    if s.run:
        metrics.PLAIN_RUN_ROUNDS.labels(SERVICE).inc()
    if s.ahead:
        metrics.AHEAD_ROUNDS.labels(SERVICE).inc()
    if s.ahead_hit:
        metrics.AHEAD_HITS.labels(SERVICE).inc()
    if s.drafted_in_verify:
        metrics.DRAFTS_IN_VERIFY.labels(SERVICE).inc()
    if s.tree_run:
        metrics.TREE_RUN_ROUNDS.labels(SERVICE).inc()
    metrics.VERIFY_SECONDS.labels(SERVICE).observe(s.verify_s)
    if s.tree_size:
        metrics.DRAFT_SECONDS.labels(SERVICE).observe(s.draft_s)
