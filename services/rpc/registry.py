"""Registration of drafter and verifier replicas in Redis, and its reading by coordinators.

    aerie:instance:{role}:{address}   hash  role, address, model, draft, capacity, load, heartbeat
                                            expires AERIE_HEARTBEAT_TTL_S after the last heartbeat

A service started with a Redis URL (`--redis-url` / AERIE_REDIS_URL) runs a `Registration`: every
AERIE_HEARTBEAT_S it rewrites its record (its load is the number of sequences holding KV there) and
renews the TTL; on shutdown it deletes it. A replica that dies stops renewing, and its record expires:
coordinators (`Registry.instances`) stop placing sequences there without being told. Without a
Redis URL nothing is registered and coordinators use their static address lists.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.rpc.security import redact
from services.rpc.config import ConfigError, env

log = logging.getLogger("aerie.registry")
PREFIX = "aerie:instance:"


@dataclass(frozen=True, slots=True)
class Instance:
    role: str  # "verifier" | "drafter"
    address: str  # host:port that coordinators dial
    model: str  # the target checkpoint
    draft: str  # the draft head ("" for a verifier)
    capacity: int  # max sequences
    load: int  # sequences holding KV at the last heartbeat
    heartbeat: float  # unix time of the last heartbeat


@dataclass(frozen=True, slots=True)
class RegistrationConfig:
    redis_url: str
    advertise: str  # host:port to register; "" = this host's address and the serving port
    heartbeat_s: float = 2.0
    ttl_s: float = 6.0

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://; got {redact(self.redis_url)!r}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ConfigError(f"need 0 < heartbeat_s < heartbeat_ttl_s; got {self.heartbeat_s} and {self.ttl_s}")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("registration (optional: with a Redis URL the replica registers itself)")
    g.add_argument("--redis-url", default=env("AERIE_REDIS_URL", ""),
                   help="register in this Redis with a heartbeat (AERIE_REDIS_URL; empty = do not register)")
    g.add_argument("--advertise-address", default=env("AERIE_ADVERTISE_ADDRESS", ""),
                   help="host:port coordinators dial (AERIE_ADVERTISE_ADDRESS; default: this host's "
                        "address and the serving port)")
    g.add_argument("--heartbeat-s", type=float, default=env("AERIE_HEARTBEAT_S", 2.0),
                   help="heartbeat period (AERIE_HEARTBEAT_S, 2)")
    g.add_argument("--heartbeat-ttl-s", type=float, default=env("AERIE_HEARTBEAT_TTL_S", 6.0),
                   help="a record expires this long after the last heartbeat (AERIE_HEARTBEAT_TTL_S, 6)")


def from_args(args: argparse.Namespace) -> RegistrationConfig | None:
    if not getattr(args, "redis_url", ""):
        return None
    return RegistrationConfig(args.redis_url, args.advertise_address, args.heartbeat_s, args.heartbeat_ttl_s)


def _redis_error() -> type[Exception]:
    import redis

    return redis.RedisError


def key(role: str, address: str) -> str:
    return f"{PREFIX}{role}:{address}"


def advertised_address(host: str, port: int, advertise: str = "") -> str:
    if advertise:
        return advertise
    if host in ("", "0.0.0.0", "::"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect(url: str):
    import redis  # not at import time: the flags above build `aerie verifier --help`

    from services.rpc.security import redis_password

    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2,
                                **redis_password())


class Registration:
    """The service side: heartbeats on a daemon thread until `stop`."""

    def __init__(self, client, role: str, address: str, describe: Callable[[], dict],
                 heartbeat_s: float = 2.0, ttl_s: float = 6.0) -> None:
        self.redis = client
        self.role = role
        self.address = address
        self.describe = describe  # -> {"model", "draft", "capacity", "load"}
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{role}-heartbeat", daemon=True)
        self._ok = None

    def start(self) -> Registration:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> bool:
        fields = {"role": self.role, "address": self.address, "heartbeat": f"{time.time():.3f}", **self.describe()}
        try:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key(self.role, self.address), mapping={k: str(v) for k, v in fields.items()})
                pipe.pexpire(key(self.role, self.address), int(self.ttl_s * 1000))
                pipe.execute()
        except _redis_error() as e:
            if self._ok is not False:
                log.warning("%s %s cannot register in Redis (retrying every %g s): %s", self.role, self.address,
                            self.heartbeat_s, e)
            self._ok = False
            return False
        if self._ok is not True:
            log.info("%s %s registered (heartbeat %g s, ttl %g s)", self.role, self.address, self.heartbeat_s,
                     self.ttl_s)
        self._ok = True
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()

    def stop(self) -> None:
        """Stop heartbeating and remove the record (coordinators stop placing here at once)."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.redis.delete(key(self.role, self.address))
        except _redis_error() as e:
            log.warning("cannot unregister %s %s: %s", self.role, self.address, e)


class Registry:
    """The coordinator side: the replicas whose heartbeat has not expired."""

    def __init__(self, client) -> None:
        self.redis = client

    def instances(self, role: str) -> dict[str, Instance]:
        keys = list(self.redis.scan_iter(match=f"{PREFIX}{role}:*", count=1000))
        if not keys:
            return {}
        with self.redis.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hgetall(k)
            records = pipe.execute()
        out = {}
        for h in records:
            if not h or "address" not in h:
                continue  # expired between SCAN and HGETALL
            try:
                out[h["address"]] = Instance(role, h["address"], h.get("model", ""), h.get("draft", ""),
                                             int(h.get("capacity", 0)), int(h.get("load", 0)),
                                             float(h.get("heartbeat", 0)))
            except ValueError:
                log.warning("ignoring a malformed %s record: %s", role, h)
        return out
