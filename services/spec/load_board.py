"""The load: the other sequences that share one verifier's target forwards (continuous batching),
as the budget sees them when it plans one sequence's round.

    board = LoadBoard()                        # one per verifier (in process) or verifier address
    board.join(key)                            # a sequence starts: counted as a plain step
    load = board.others(key)                   # -> Load: what the others asked for
    board.post(key, rows, tokens, draft_s)     # this sequence's latest plan
    board.observe_draft(s); board.observe_verify(s)   # measured latency beyond the cost model
    board.observe_plain(s)                     # ... of a plain round (a Decode, in runs where they run)
    board.leave(key)

Thread-safe; pure (no I/O).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass

EXTRAS = ("draft", "verify", "plain")  # the kinds of LoadBoard's measured latencies


@dataclass(frozen=True, slots=True)
class Load:
    """What the other sequences batched into the same target forwards asked for in their latest
    round (their plans): the batch this sequence's rows join."""

    sequences: int = 0
    rows: float = 0.0  # rows they verify per forward (1 for a plain decode step)
    tokens: float = 0.0  # tokens they are predicted to commit per forward
    draft_s: float = 0.0  # their draft seconds per round
    draft_extra: float = 0.0  # measured: a draft's latency beyond the cost model's compute, seconds
    verify_extra: float = 0.0  # measured: a round's verify latency beyond the modelled forward, seconds
    # measured: a plain round's (a Decode: in plain runs through the services, chained by the
    # verifier) latency beyond the modelled forward; None until one was measured (verify_extra then)
    plain_extra: float | None = None


def same_load(a: Load, b: Load, tolerance: float = 0.1) -> bool:
    """Whether two loads are the same batch for planning: the same sequences, rows and tokens (to
    0.001) and seconds within `tolerance` relative (or 0.5 ms): the measured extras move by less
    than their noise from round to round, and a steady batch must not be re-planned for that."""
    def near(x: float, y: float) -> bool:
        return abs(x - y) <= max(5e-4, tolerance * max(abs(x), abs(y)))

    return (a.sequences == b.sequences and abs(a.rows - b.rows) < 1e-3 and abs(a.tokens - b.tokens) < 1e-3
            and near(a.draft_s, b.draft_s) and near(a.draft_extra, b.draft_extra)
            and near(a.verify_extra, b.verify_extra)
            and (a.plain_extra is None and b.plain_extra is None
                 or a.plain_extra is not None and b.plain_extra is not None and near(a.plain_extra, b.plain_extra)))


class LoadBoard:
    """The sequences that share one verifier's forwards (continuous batching), each with its latest
    plan, and two latencies measured on the rounds they run (each the median of its latest `window`
    observations, never below 0): how much longer a
    draft takes than the cost model's compute for it (the draft call's round trip, the drafter's
    queue, catching up the draft KV) and how much longer a verify call takes than the modelled
    forward (the verify call's round trip, the batch's gathering, a batch forward's per-sequence
    attention), that of tree rounds and that of plain rounds apart: through the services a plain
    round is a Decode, and in plain runs the verifier chains them without a round trip each, where a
    tree round is a call of its own. The calibrated curves are one sequence's forward in process;
    these extras are what the services add on this machine, and the chooser charges them
    (Budget._choose).
    A median, not a mean: single rounds cost far more than a steady round's extra (a service's first
    draft, a draft that catches the draft KV up after plain rounds, the first Verify after a run was
    closed, which waits for the run's step in flight); an EMA of them kept the budget plain for
    hundreds of rounds after a service's first request (docs/benchmarks.md, "Tree runs with the
    adaptive budget, and the board's extras").
    Observations are kept as measured (a round from a run can wait less than the model's forward).
    Thread-safe; one per verifier (in process) or per verifier address (coordinator)."""

    def __init__(self, window: int = 9, decay: float = 1 / 160, name: str = "") -> None:
        self.name = name  # what it is the board of (the coordinator's: its verifier's address)
        self._lock = threading.Lock()
        self._plans: dict[str, tuple[float, float, float]] = {}  # key -> (rows, tokens, draft_s)
        self.decay = decay  # the draft extra's share forgotten per verify or plain round (observe_verify)
        self._seen: dict[str, deque[float]] = {kind: deque(maxlen=window) for kind in EXTRAS}  # observations
        self.realized: float | None = None  # the latest AcceptanceStats.realized of a greedy sequence
        #                                     here (None until one drafted): where new ones start

    def others(self, key: str) -> Load:
        extras = self.extras()
        with self._lock:
            rest = [v for k, v in self._plans.items() if k != key]
        return Load(len(rest), sum(r for r, _, _ in rest), sum(t for _, t, _ in rest), sum(d for _, _, d in rest),
                    extras.get("draft", 0.0), extras.get("verify", 0.0), extras.get("plain"))

    def extras(self) -> dict[str, float]:
        """The measured extras so far, seconds by kind ('draft', 'verify', 'plain'; a kind not measured
        yet is left out): each the median of its window, never below 0."""
        with self._lock:
            return {kind: max(0.0, statistics.median(seen)) for kind, seen in self._seen.items() if seen}

    def observe_draft(self, excess_s: float) -> None:
        """One draft call's measured seconds minus the cost model's compute for it."""
        self._observe("draft", excess_s)

    def observe_verify(self, excess_s: float) -> None:
        """One tree round's verify call's measured seconds minus the modelled batch forward. The draft
        extra is forgotten slowly meanwhile (its observations shrink by `decay` per call): measured
        under another load (a burst of catch-up drafts), it must not rule out drafting, and probing,
        for good."""
        self._observe("verify", excess_s, decay=True)

    def observe_plain(self, excess_s: float) -> None:
        """One plain round's measured seconds minus the modelled batch forward (as observe_verify)."""
        self._observe("plain", excess_s, decay=True)

    def _observe(self, kind: str, x: float, decay: bool = False) -> None:
        if not math.isfinite(x):
            return
        with self._lock:
            self._seen[kind].append(x)
            if decay:
                draft = self._seen["draft"]
                for i in range(len(draft)):
                    draft[i] *= 1.0 - self.decay

    def post(self, key: str, rows: float, tokens: float, draft_s: float) -> None:
        with self._lock:
            self._plans[key] = (rows, tokens, draft_s)

    def join(self, key: str) -> None:
        """A sequence starts (before its prefill): until it plans, the others count it as a plain
        step, so sequences that start together see each other from their first plan on."""
        with self._lock:
            self._plans.setdefault(key, (1.0, 1.0, 0.0))

    def leave(self, key: str) -> None:
        with self._lock:
            self._plans.pop(key, None)

    def rows(self) -> dict[str, float]:
        """key -> the rows of that sequence's latest plan (1 = a plain decode step)."""
        with self._lock:
            return {k: v[0] for k, v in self._plans.items()}
