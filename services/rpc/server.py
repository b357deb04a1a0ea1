"""gRPC server plumbing: the `create_server` factory every service uses, and the process loop that
serves until SIGTERM/SIGINT and then drains.

    server, port = await create_server("127.0.0.1:0", config, "verifier", register)

The server is a started `grpc.aio` server with the standard health service (every registered service
and "" SERVING), the tracing interceptor and message-size limits. On SIGTERM `serve_forever` marks
health NOT_SERVING, stops accepting calls and gives in-flight calls `drain_s` seconds to finish
(a round in progress completes), then runs the service's own `on_stop` hook.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import telemetry
from services.metrics import BATCH_QUEUE, BATCH_ROWS, BATCH_SIZE, serve_metrics
from services.rpc.config import ServiceConfig
from services.rpc.interceptors import ServerAuth, ServerDecoding, ServerTracing
from services.rpc.security import Security

log = logging.getLogger("aerie.rpc")
_HEALTH: weakref.WeakKeyDictionary[grpc.aio.Server, health.aio.HealthServicer] = weakref.WeakKeyDictionary()
_HEALTH_ONLY: weakref.WeakKeyDictionary[grpc.aio.Server, grpc.aio.Server] = weakref.WeakKeyDictionary()


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0]
    return host.strip("[]")


def auth_interceptors(security: Security, service: str) -> list[grpc.aio.ServerInterceptor]:
    """The coordinator checks API tokens (the public API); drafters and verifiers the internal token."""
    if service == "coordinator":
        return [ServerAuth(security.api_tokens, "an API token")] if security.api_tokens else []
    if security.internal_token:
        return [ServerAuth({security.internal_token: "coordinator"}, "the internal token (AERIE_INTERNAL_TOKEN)")]
    return []


def trust_summary(security: Security, service: str, address: str) -> tuple[str, bool]:
    """(one start-up line saying which controls are on, whether it is a warning). A server that
    listens beyond loopback without TLS is allowed (a private network, a sidecar that terminates
    TLS) but warned about: its traffic and any token on it are readable on the network."""
    internal = service != "coordinator"
    parts = ["TLS" + (" with client certificates (mTLS)" if internal and security.ca else "") if security.tls
             else "plaintext (no TLS)"]
    if internal:
        parts.append("internal token required" if security.internal_token else "no internal token")
    else:
        parts.append(f"{len(set(security.api_tokens.values()))} API identities" if security.api_tokens
                     else "no API tokens (every caller is 'anonymous')")
    host = _host_of(address)
    if security.tls or is_loopback(host):
        mode = "local mode: loopback only" if is_loopback(host) and not security.tls else "secured"
        return f"{service} security: {mode}; " + ", ".join(parts), False
    return (f"{service} listens on {host} WITHOUT TLS: anyone on the network can read and send its traffic; "
            f"set AERIE_TLS_CERT/AERIE_TLS_KEY (docs/security.md) or bind 127.0.0.1; " + ", ".join(parts)), True


async def create_server(address: str, config: ServiceConfig, service: str,
                        register: Callable[[grpc.aio.Server], Sequence[str]],
                        security: Security | None = None) -> tuple[grpc.aio.Server, int]:
    """A started server on `address` (port 0 = any free port). `register` adds the servicers and
    returns their full service names (for the health service). `security` (default: loaded from the
    config's files) decides TLS / mTLS and the token checks (services/rpc/security.py)."""
    security = security if security is not None else Security.load(config)
    server = grpc.aio.server(interceptors=[*auth_interceptors(security, service), ServerDecoding(),
                                           ServerTracing(service)],
                             options=message_options(config.max_message_bytes))
    names = register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    credentials = security.server_credentials(require_client_cert=service != "coordinator")
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    line, warn = trust_summary(security, service, address)
    (log.warning if warn else log.info)(line)
    await server.start()
    _HEALTH[server] = health_servicer
    if config.health_port is not None:
        _HEALTH_ONLY[server] = await _health_only_server(health_servicer, config)
    return server, port


async def _health_only_server(health_servicer, config: ServiceConfig) -> grpc.aio.Server:
    """AERIE_HEALTH_PORT: a plaintext server with the same health servicer and nothing else, for
    probes that cannot speak TLS (kubelet gRPC probes). It reveals SERVING / NOT_SERVING only."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host = config.host
    address = f"[{host}]:{config.health_port}" if ":" in host else f"{host}:{config.health_port}"
    server.add_insecure_port(address)
    await server.start()
    return server


def health_of(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """The health servicer `create_server` added to `server` (to report NOT_SERVING on a fault)."""
    return _HEALTH[server]


async def drain(server: grpc.aio.Server, grace_s: float,
                before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Health NOT_SERVING, (then the service's own `before_stop`, e.g. the coordinator handing its
    sequences over while its streams are still open), refuse new calls, let in-flight ones finish for
    up to `grace_s`."""
    health_servicer = _HEALTH.get(server)
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    if before_stop is not None:
        await before_stop()
    await server.stop(grace_s)
    health_only = _HEALTH_ONLY.pop(server, None)
    if health_only is not None:
        await health_only.stop(None)


async def set_serving(server: grpc.aio.Server, serving: bool, names: Sequence[str] = ()) -> None:
    """Health of "" and `names`: SERVING or NOT_SERVING (e.g. the coordinator while Redis is down).
    Ignored once the server drains (the health service stays NOT_SERVING)."""
    health_servicer = _HEALTH.get(server)
    if health_servicer is None:
        return
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *names):
        await health_servicer.set(name, status)


def write_port_file(path: str, **ports: int | None) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(ports))
    os.replace(tmp, path)


async def serve_forever(start: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]], config: ServiceConfig,
                        service: str, on_stop: Callable[[], Awaitable[None]] | None = None,
                        extra_ports: dict[str, int] | None = None,
                        on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start, serve until SIGTERM or SIGINT, drain, stop. `extra_ports` (filled by `start`, e.g. the
    coordinator's HTTP API) go into the port file too. `on_drain` runs after health turns NOT_SERVING
    and before the server stops taking calls (see `drain`)."""
    telemetry.setup(f"aerie-{service}")
    server, port = await start()
    metrics_port = serve_metrics(config.metrics_port, config.host)
    log.info("%s listening on %s:%d (metrics: %s)%s", service, config.host, port,
             f"port {metrics_port}" if metrics_port is not None else "off",
             "".join(f", {k} {v}" for k, v in (extra_ports or {}).items()))
    if config.port_file:
        write_port_file(config.port_file, port=port, metrics_port=metrics_port, **(extra_ports or {}))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s draining (up to %.0f s)", service, config.drain_s)
    await drain(server, config.drain_s, on_drain)
    if on_stop is not None:
        await on_stop()
    telemetry.shutdown()
    log.info("%s stopped", service)


async def timed(histogram, awaitable):
    """Await and observe the wall time (queueing and batching included) in `histogram`."""
    t0 = time.perf_counter()
    try:
        return await awaitable
    finally:
        histogram.observe(time.perf_counter() - t0)


def batch_observer(service: str):
    """A Batcher `on_batch` hook that exports each forward's batch size, rows and queue length."""
    def observe(stats) -> None:
        BATCH_SIZE.labels(service).observe(stats.size)
        BATCH_ROWS.labels(service).observe(stats.rows)
        BATCH_QUEUE.labels(service).set(stats.waiting)

    return observe
