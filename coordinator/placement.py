"""Placement: which drafter and which verifier replica a new sequence goes to.

A `Pool` holds one role's replicas. Its configured entries are host:port; each host may resolve to
several addresses (a Kubernetes headless service has one per pod), and `refresh` re-resolves them,
so replicas join and leave without a restart (replicas registered in Redis, see
services/rpc/registry.py, join and leave the same way, read every discover interval): a new address gets a channel, a vanished one gets no
new sequences (sequences already there finish on it; its channel closes once idle).

`acquire` picks the replica with the fewest sequences placed by this coordinator (ties by address),
skipping replicas that do not answer; the sequence then stays there (its KV lives there) until
`release`. NOTE: the load is this coordinator's own view; with several coordinators each balances
its share.

A replica whose call failed (`mark_failed`: UNAVAILABLE or a missed deadline) leaves placement at
once: `acquire` skips it, whatever GetInfo answer is cached, until `probe_interval_s` has passed and
a fresh GetInfo succeeds. `acquire(wait_s=...)` polls for up to that long when none answers.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import grpc

from services.rpc.clients import ServiceClient
from services.rpc.errors import DownstreamError
from services.rpc.registry import Instance

log = logging.getLogger("aerie.coordinator")
C = TypeVar("C", bound=ServiceClient)


def resolve_entry(entry: str) -> set[str]:
    """'verifier-headless:50052' -> {'10.0.0.7:50052', '10.0.0.8:50052'}; IPv4 addresses are
    preferred when a name has both (services usually listen on 0.0.0.0)."""
    host, _, port = entry.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
        return {f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"}
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    v4 = {f"{i[4][0]}:{port}" for i in infos if i[0] == socket.AF_INET}
    return v4 or {f"[{i[4][0]}]:{port}" for i in infos if i[0] == socket.AF_INET6}


class Pool(Generic[C]):
    def __init__(self, role: str, entries: Iterable[str], connect: Callable[[str], C],
                 resolve: Callable[[str], set[str]] = resolve_entry, probe_interval_s: float = 2.0,
                 discover: Callable[[], dict[str, Instance]] | None = None) -> None:
        self.role = role
        self.entries = tuple(entries)
        self._connect = connect
        self._resolve = resolve
        self._lock = threading.Lock()
        self._resolved: dict[str, set[str]] = {}  # entry -> its addresses at the last good resolution
        self._clients: dict[str, C] = {}
        self._active: set[str] = set()
        self._load: Counter[str] = Counter()
        self._failed: dict[str, tuple[float, str]] = {}  # address -> (time it may be probed again, why)
        self.probe_interval_s = probe_interval_s
        self._discover = discover
        self._discovered: dict[str, Instance] = {}  # registered replicas at the last good read of Redis
        self.refresh()

    def refresh(self, resolve: bool = True) -> None:
        """Re-read the registry (if any) and, when `resolve`, re-resolve the static entries."""
        for entry in self.entries if resolve else ():
            try:
                self._resolved[entry] = self._resolve(entry)
            except OSError as e:  # keep the last good answer while DNS is unhappy
                log.warning("cannot resolve %s %s: %s", self.role, entry, e)
        if self._discover is not None:
            try:
                self._discovered = self._discover()
            except Exception as e:  # noqa: BLE001 - Redis down: keep the last good answer
                log.warning("cannot read the %s registry: %s", self.role, e)
        addresses = set().union(*self._resolved.values()) if self._resolved else set()
        addresses |= self._discovered.keys()
        with self._lock:
            for address in addresses - self._clients.keys():
                log.info("%s %s joined the pool", self.role, address)
                self._clients[address] = self._connect(address)
            for address in self._active - addresses:
                log.info("%s %s left the pool", self.role, address)
            self._active = addresses
            self._close_idle()

    def acquire(self, exclude: Iterable[str] = (), wait_s: float = 0.0, prefer: str = "") -> C:
        """The least-loaded replica that answers, not in `exclude` (`prefer`: that address first when it
        answers: a drafter in the sequence's verifier process); polls up to `wait_s` seconds when
        none does, then raises DownstreamError(UNAVAILABLE) naming why each one was skipped."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._acquire_once(frozenset(exclude), prefer)
            except DownstreamError as e:
                if time.monotonic() >= deadline:
                    if wait_s > 0:
                        raise DownstreamError(e.code, f"{e} (waited {wait_s:g} s)") from None
                    raise
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def try_acquire(self, exclude: Iterable[str] = (), prefer: str = "") -> C | None:
        """`acquire` without waiting; None when no replica answers."""
        try:
            return self._acquire_once(frozenset(exclude), prefer)
        except DownstreamError:
            return None

    def _acquire_once(self, exclude: frozenset[str], prefer: str = "") -> C:
        now = time.monotonic()
        with self._lock:
            # least loaded: this coordinator's placements, or the replica's own heartbeat count when
            # higher (it includes other coordinators' sequences)
            reported = {a: i.load for a, i in self._discovered.items()}
            order = sorted(self._active - exclude,
                           key=lambda a: (a != prefer, max(self._load[a], reported.get(a, 0)), a))
            failed = dict(self._failed)
        errors = []
        for address in order:
            client = self._clients[address]
            if address in failed and failed[address][0] > now:
                errors.append(failed[address][1])
                continue
            try:
                if address in failed:
                    client.info(refresh=True)  # probed again after a failure
                else:
                    client.info()  # cached after the first answer
            except DownstreamError as e:
                self.mark_failed(address, str(e))
                errors.append(str(e))
                continue
            with self._lock:
                self._failed.pop(address, None)
                self._load[address] += 1
            return client
        detail = "; ".join(errors) if errors else f"none configured or resolved from {list(self.entries)}"
        raise DownstreamError(grpc.StatusCode.UNAVAILABLE, f"no {self.role} available: {detail}")

    def mark_failed(self, address: str, reason: str) -> None:
        """Drop `address` from placement until a GetInfo probe succeeds (after probe_interval_s)."""
        with self._lock:
            if address not in self._failed:
                log.warning("%s %s dropped from placement: %s", self.role, address, reason)
            self._failed[address] = (time.monotonic() + self.probe_interval_s, reason)

    def failed(self) -> set[str]:
        with self._lock:
            return set(self._failed)

    def release(self, client: C) -> None:
        with self._lock:
            self._load[client.address] -= 1
            self._close_idle()

    def loads(self) -> dict[str, int]:
        with self._lock:
            return {a: self._load[a] for a in sorted(self._active)}

    def clients(self) -> list[C]:
        """The replicas new sequences may go to (GetInfo asks each whether it answers)."""
        with self._lock:
            return [self._clients[a] for a in sorted(self._active)]

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
            self._active.clear()

    def _close_idle(self) -> None:
        for address in [a for a in self._clients if a not in self._active and self._load[a] <= 0]:
            self._clients.pop(address).close()


class Refresher:
    """Re-reads the registry every `discover_interval_s` and re-resolves host names every
    `resolve_interval_s`, on a daemon thread until `stop`."""

    def __init__(self, pools: Iterable[Pool], resolve_interval_s: float, discover_interval_s: float | None = None
                 ) -> None:
        self._pools = list(pools)
        self._resolve_interval_s = resolve_interval_s
        self._interval_s = min(resolve_interval_s, discover_interval_s or resolve_interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-refresh", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_resolve = time.monotonic()
        while not self._stop.wait(self._interval_s):
            resolve = time.monotonic() - last_resolve >= self._resolve_interval_s
            if resolve:
                last_resolve = time.monotonic()
            for pool in self._pools:
                pool.refresh(resolve)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
