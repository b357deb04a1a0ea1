"""The tracing spans of one sequence:

    generate                       the request (under the client's span when it sent traceparent)
      round {round_index=0}        the prefill round: verify (the verifier's Prefill), commit
      round {round_index=k}        draft (the tree round k verifies), verify, commit
        draft / verify             CLIENT spans; the drafter / verifier add their SERVER span below
        commit                     the Redis commit

With drafting ahead (AERIE_OVERLAP), a `draft_ahead` CLIENT span (the DraftAhead call, from the
engine's drafter thread) runs beside the round's `verify` span: the two overlap on the timeline; the
round span carries ahead / ahead_hit / saved_s.

A fail-over or a rebuild adds an event ("failover": role, from, to, reason; "rebuild": role, rows,
seconds) to the round span open at that moment (else to the request span).

A round span opens with its first phase and ends after its commit, carrying the round index, tree
size and depth, accept length and the latency of each phase. The draft of round k+1 runs before
round k is committed (the engine grows the next tree before yielding a round), so consecutive round
spans overlap slightly. Everything is a no-op when tracing is off.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ContextManager

from services import telemetry
from services.engine.engine import RoundStats


class RoundSpans:
    def __init__(self, seq_id: str, request_span: Any) -> None:
        self.seq_id = seq_id
        self.request_span = request_span  # None when tracing is off
        self._rounds: dict[int, Any] = {}
        self._lock = threading.Lock()  # phases open from the sequence's thread and its drafter thread

    def phase(self, round_index: int, name: str) -> ContextManager:
        if self.request_span is None:
            return contextlib.nullcontext()
        kind = "internal" if name == "commit" else "client"
        return telemetry.start_span(name, parent=self._round(round_index), kind=kind,
                                    attributes={**_round_index(round_index), telemetry.SEQ_ID: self.seq_id})

    def _round(self, round_index: int):
        with self._lock:
            span = self._rounds.get(round_index)
            if span is None:
                span = telemetry.begin_span("round", parent=self.request_span,
                                            attributes={**_round_index(round_index), telemetry.SEQ_ID: self.seq_id})
                self._rounds[round_index] = span
            return span

    def event(self, name: str, attributes: dict[str, Any]) -> None:
        """An event on the latest open round span (else the request span); a no-op without tracing."""
        if self.request_span is None:
            return
        with self._lock:
            span = self._rounds[max(self._rounds)] if self._rounds else self.request_span
        span.add_event(name, attributes)

    def end_round(self, stats: RoundStats, commit_s: float) -> None:
        with self._lock:
            span = self._rounds.pop(stats.round_index, None)
        if span is None:
            return
        span.set_attributes({
            telemetry.TREE_SIZE: stats.tree_size, telemetry.TREE_NODES: stats.tree_size,
            telemetry.TREE_MAX_DEPTH: stats.tree_max_depth, telemetry.TREE_DEPTH: stats.tree_max_depth,
            telemetry.ACCEPT_LENGTH: stats.accept_length, telemetry.DRAFT_S: stats.draft_s,
            telemetry.VERIFY_S: stats.verify_s, telemetry.COMMIT_S: commit_s,
            telemetry.ROUND_S: stats.draft_s + stats.verify_s + commit_s,
            telemetry.AHEAD: stats.ahead, telemetry.AHEAD_HIT: stats.ahead_hit, telemetry.SAVED_S: stats.saved_s,
        })
        span.end()

    def close(self) -> None:
        """End rounds that never committed (a draft grown for a round that did not happen)."""
        with self._lock:
            spans, self._rounds = list(self._rounds.values()), {}
        for span in spans:
            span.end()


def _round_index(round_index: int) -> dict[str, int]:
    """The round's number under its name and (one more release) its deprecated one."""
    return {telemetry.ROUND_INDEX: round_index, telemetry.ROUND: round_index}
