"""Requests per second per client: a token bucket per client key (the API identity, else the peer host,
or the HTTP caller a trusted gateway names: services/rpc/forwarded.py).

    limits = RateLimits(rate_per_s=5, burst=10)       # rate 0 = off
    wait_s = limits.take("identity alice")              # 0.0: admitted (one token taken); > 0: refused,
                                                        #   a token is back in wait_s seconds

Each client's bucket holds up to `burst` tokens and refills at `rate_per_s`; a request takes one. A
refused request takes nothing, so a client that keeps retrying too fast is refused until it slows
down, and other clients are not affected. The coordinator refuses with RESOURCE_EXHAUSTED and the
`retry-after` trailing metadata; the HTTP API answers 429 with Retry-After (gateway/errors.py).

Pure (the clock is injected), no I/O. Buckets that have refilled completely are dropped when the map
grows past `max_clients`, so memory follows the clients seen recently, not every client ever seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.errors import CapacityExceeded
from services.rpc.config import ConfigError


class RateLimited(CapacityExceeded):
    """A client over its request rate (RESOURCE_EXHAUSTED, retry-after metadata; HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimits:
    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = 10_000) -> None:
        if not rate_per_s >= 0:
            raise ConfigError(f"rate_limit_rps must be >= 0 (0 = off); got {rate_per_s}")
        if burst < 1:
            raise ConfigError(f"rate_limit_burst must be >= 1; got {burst}")
        self.rate_per_s, self.burst = rate_per_s, burst
        self._clock = clock
        self._max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when counted)

    @property
    def on(self) -> bool:
        return self.rate_per_s > 0

    def take(self, client: str) -> float:
        """Take one token of `client`'s bucket: 0.0, or the seconds until one is back (nothing taken)."""
        if not self.on:
            return 0.0
        now = self._clock()
        tokens, then = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            return (1.0 - tokens) / self.rate_per_s
        self._buckets[client] = (tokens - 1.0, now)
        if len(self._buckets) > self._max_clients:
            self._forget_full(now)
        return 0.0

    def check(self, client: str) -> None:
        """`take`, raising RateLimited naming the client, the limit and when to retry."""
        wait_s = self.take(client)
        if wait_s > 0:
            raise RateLimited(f"{client} is over its rate limit of {self.rate_per_s:g} requests/s (burst "
                              f"{self.burst}; AERIE_RATE_LIMIT_RPS, AERIE_RATE_LIMIT_BURST): retry in "
                              f"{wait_s:.2f} s", wait_s)

    def _forget_full(self, now: float) -> None:
        for client, (tokens, then) in list(self._buckets.items()):
            if tokens + (now - then) * self.rate_per_s >= self.burst:
                del self._buckets[client]
