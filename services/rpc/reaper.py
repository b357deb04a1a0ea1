"""Reaping: a drafter or verifier frees the KV of sequences nobody has touched for `idle_ttl_s`.

A coordinator that dies (or loses its network) never sends Release. Every model call on a sequence
touches it; a daemon thread looks every `idle_ttl_s / 4` (at most 5 s) for sequences idle longer
than the TTL and releases them on the service's model worker, so a release never races a forward.
A coordinator that comes back for a reaped sequence gets NOT_FOUND and rebuilds it (fail-over).
AERIE_IDLE_TTL_S (600) must stay well above the longest round; 0 turns reaping off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("aerie.reaper")


class IdleSequences:
    """Last-use time of each sequence a service holds (thread-safe)."""

    def __init__(self, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_ttl_s = idle_ttl_s
        self.clock = clock  # seconds; tests set a manual clock so that idleness does not follow the load
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def touch(self, seq_id: str) -> None:
        with self._lock:
            self._seen[seq_id] = self.clock()

    def forget(self, seq_id: str) -> None:
        with self._lock:
            self._seen.pop(seq_id, None)

    def expired(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        with self._lock:
            return [s for s, t in self._seen.items() if now - t > self.idle_ttl_s]


class Reaper:
    """Calls `release(seq_id)` (it must run the release on the model worker and wait for it) for every
    sequence idle longer than the TTL, until `stop`."""

    def __init__(self, role: str, idle: IdleSequences, release: Callable[[str], object]) -> None:
        self.role = role
        self.idle = idle
        self.release = release
        self.reaped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{role}-reaper", daemon=True)
        if idle.idle_ttl_s > 0:
            self._thread.start()

    def sweep(self) -> list[str]:
        gone = self.idle.expired()
        for seq_id in gone:
            log.warning("%s: releasing sequence %s, idle for more than %g s (its coordinator is gone?)",
                        self.role, seq_id, self.idle.idle_ttl_s)
            self.release(seq_id)
            self.reaped += 1
        return gone

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.idle.idle_ttl_s / 4)):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad release
                log.exception("%s reaper sweep failed", self.role)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
