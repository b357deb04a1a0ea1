"""The drafter's load as one sequence sees it: the share of the last `window_s` seconds the model
thread spent on batches holding OTHER sequences (DraftResponse.busy).

A sequence's own drafts are not load for it: its ahead draft cannot wait behind them (one call of a
sequence at a time). Work for other sequences is what an ahead draft queues behind or delays, so
the coordinator's overlap policy (services/spec/overlap.py, `busy`) drafts ahead less when it is high.

    load = DrafterLoad(window_s=2.0, clock=time.monotonic)
    load.ran(t0, t1, {"a", "b"})    # a batch of sequences a and b ran from t0 to t1
    load.busy("a")                   # 0..1: the batches with some sequence other than "a", in the window

It does not time anything itself except through `clock` (tests pass an explicit one).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class DrafterLoad:
    def __init__(self, window_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0; got {window_s}")
        self.window_s, self.clock = window_s, clock
        self._batches: deque[tuple[float, float, frozenset[str]]] = deque()  # (start, end, sequences)
        self._lock = threading.Lock()

    def ran(self, start: float, end: float, seq_ids: set[str] | frozenset[str]) -> None:
        """A batch of `seq_ids` ran on the model thread from `start` to `end` (clock seconds)."""
        with self._lock:
            self._batches.append((start, end, frozenset(seq_ids)))
            self._trim(end)

    def busy(self, seq_id: str) -> float:
        """The share of the window [now - window_s, now] spent on batches holding another sequence."""
        now = self.clock()
        lo = now - self.window_s
        with self._lock:
            self._trim(now)
            spent = sum(max(0.0, min(end, now) - max(start, lo)) for start, end, ids in self._batches
                        if ids - {seq_id})
        return min(1.0, spent / self.window_s)

    def _trim(self, now: float) -> None:
        while self._batches and self._batches[0][1] < now - self.window_s:
            self._batches.popleft()
