"""Build the coordinator: Redis store, drafter and verifier pools, admission, servicer, server.

    coordinator = build(config)
    server, port = await create_server("127.0.0.1:0", config, coordinator)
    ...; coordinator.close(drain_s)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from services.rpc import server as rpc_server
from services.rpc.clients import DrafterClient, VerifierClient
from services.rpc.registry import Registry
from services.rpc.security import Security
from services.rpc.stubs import coordinator_grpc
from coordinator.config import CoordinatorConfig
from coordinator.leases import LeaseKeeper
from coordinator.placement import Pool, Refresher
from coordinator.redis_watch import RedisWatch
from coordinator.sequence_store import SequenceStore
from coordinator.sequences import Sequences
from coordinator.servicer import CoordinatorServicer

SERVICE_NAME = "aerie.v1.Coordinator"
LIVENESS = "liveness"  # a health name that stays SERVING while Redis is down (the chart's liveness probe)
REDIS_CHECK_S = 1.0  # PING Redis this often (backing off from 0.1 s while it is down): health follows it
log = logging.getLogger("aerie.coordinator")


@dataclass
class Coordinator:
    servicer: CoordinatorServicer
    sequences: Sequences
    store: SequenceStore
    pools: list[Pool]
    refresher: Refresher
    leases: LeaseKeeper | None = None
    security: Security | None = None  # TLS, tokens (services/rpc/security.py)
    redis_watch: RedisWatch | None = None  # health follows Redis (started with the server)

    def close(self, drain_s: float = 10.0) -> None:
        """Stop every sequence after its round in flight, then close channels."""
        if self.redis_watch is not None:
            self.redis_watch.stop()
        if self.leases is not None:
            self.leases.stop()
        self.sequences.drain(drain_s)
        self.refresher.stop()
        for pool in self.pools:
            pool.close()


def build(config: CoordinatorConfig) -> Coordinator:
    store = SequenceStore.from_url(config.redis_url, config.sequence_ttl_s, config.finished_ttl_s,
                                   config.redis_retry_s, config.lease_ttl_s)
    store.ping()
    security = Security.load(config.service)
    limit, timeout = config.service.max_message_bytes, config.rpc_timeout_s
    probe = config.probe_interval_s
    registry = Registry(store.redis) if config.discover else None

    def discover(role: str):
        return (lambda: registry.instances(role)) if registry is not None else None

    verifiers = Pool("verifier", config.verifiers, lambda a: VerifierClient(a, limit, timeout, security), probe_interval_s=probe,
                     discover=discover("verifier"))
    drafters = (Pool("drafter", config.drafters, lambda a: DrafterClient(a, limit, timeout, security), probe_interval_s=probe,
                     discover=discover("drafter"))
                if config.drafter_pool and (config.drafters or config.discover) else None)
    pools = [p for p in (verifiers, drafters) if p is not None]
    sequences = Sequences(config, store, verifiers, drafters)
    servicer = CoordinatorServicer(config, sequences, store, security)
    return Coordinator(servicer, sequences, store, pools,
                       Refresher(pools, config.resolve_interval_s, config.discover_interval_s),
                       LeaseKeeper(sequences, config.lease_ttl_s), security)


async def create_server(address: str, config: CoordinatorConfig, coordinator: Coordinator
                        ) -> tuple[grpc.aio.Server, int]:
    def register(server: grpc.aio.Server) -> list[str]:
        coordinator_grpc.add_CoordinatorServicer_to_server(coordinator.servicer, server)
        return [SERVICE_NAME]

    server, port = await rpc_server.create_server(address, config.service, "coordinator", register,
                                                  coordinator.security)
    await rpc_server.set_serving(server, True, [LIVENESS])
    loop = asyncio.get_running_loop()

    def on_redis(ok: bool) -> None:  # NOT_SERVING while Redis is unreachable
        asyncio.run_coroutine_threadsafe(rpc_server.set_serving(server, ok, [SERVICE_NAME]), loop).result(10)

    coordinator.redis_watch = RedisWatch(coordinator.store, on_redis, REDIS_CHECK_S, config.redis_ping_timeout_s)
    return server, port


def with_gateway_token(coordinator: Coordinator) -> str:
    """A fresh API token for the in-process HTTP gateway's own calls (identity "gateway", known to
    this process only), added to the coordinator's accepted tokens (the same dict its ServerAuth
    interceptor reads, so the order against create_server does not matter)."""
    import secrets

    token = secrets.token_urlsafe(32)
    assert coordinator.security is not None and coordinator.security.api_tokens, "only with API tokens"
    coordinator.security.api_tokens[token] = "gateway"
    return token
