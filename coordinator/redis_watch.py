"""The coordinator's health follows Redis: a coordinator that cannot reach Redis can neither admit nor
commit, so its gRPC health check says NOT_SERVING while Redis is unreachable or stalled, and SERVING
again once a PING succeeds (Kubernetes' readiness probe then takes it out of the Service and back).

    RedisWatch(store, on_change, interval_s, timeout_s)
                                    PING every `interval_s` while Redis answers, each PING on its own
                                    connection bounded by `timeout_s` (AERIE_REDIS_PING_TIMEOUT_S): a
                                    Redis that accepts connections but answers nothing (SIGSTOP, a
                                    stalled host) is down after timeout_s, not after the store's 10 s
                                    socket timeout; while it does not answer,
                                    retry with backoff (0.1 s doubling to `interval_s`); on_change(ok)
                                    when the answer flips (and once at the first check)

redis-py reconnects by itself on the next command, so a PING that succeeds is the reconnect. Sets
aerie_redis_up{service="coordinator"} (1 / 0).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services import metrics
from coordinator.sequence_store import SequenceStore

log = logging.getLogger("aerie.coordinator")


class RedisWatch:
    def __init__(self, store: SequenceStore, on_change: Callable[[bool], None], interval_s: float = 1.0,
                 timeout_s: float = 1.0) -> None:
        self.store = store
        self.on_change = on_change
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.up: bool | None = None  # unknown until the first check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-watch", daemon=True)
        self._thread.start()

    def _check(self) -> bool:
        try:
            self.store.ping(self.timeout_s)
            return True
        except Exception:  # noqa: BLE001 - any failure to PING is "down"
            return False

    def _run(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            ok = self._check()
            if ok != self.up:
                (log.info if ok else log.warning)("Redis is %s: health %s", "reachable again" if self.up is False
                                                  else "reachable" if ok else "unreachable",
                                                  "SERVING" if ok else "NOT_SERVING")
                self.up = ok
                metrics.REDIS_UP.labels("coordinator").set(1 if ok else 0)
                try:
                    self.on_change(ok)
                except Exception:  # noqa: BLE001 - the next flip tries again
                    log.exception("cannot set the health status")
            if ok:
                wait, delay = self.interval_s, 0.1
            else:  # backoff while down: 0.1, 0.2, 0.4 ... interval_s
                wait, delay = delay, min(delay * 2, self.interval_s)
            self._stop.wait(wait)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
