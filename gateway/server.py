"""Serve the HTTP API with uvicorn inside an already running asyncio loop (the coordinator's, or a
test's), next to the gRPC server:

    http = await start_http("127.0.0.1:50051", host="0.0.0.0", port=8000)   # port 0 = any free port
    http.port
    await http.stop()

Uvicorn's `startup` / `shutdown` are used instead of `serve`, so it installs no signal handlers: the
coordinator's own SIGTERM handling drains gRPC first, then stops this.

The HTTP/1.1 protocol is uvicorn's h11 one with two of gateway/limits.py's limits: a request head
(request line and headers) over AERIE_HTTP_MAX_HEADER_BYTES is answered 431 (the parser never
buffers more than that of an incomplete head; a complete one that arrived in one read is measured
before the app sees it), and a client address with AERIE_HTTP_MAX_CONNECTIONS_PER_PEER connections open gets 429
on the next one (its request is answered at once and the connection closed).
"""

from __future__ import annotations

from dataclasses import dataclass

import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.app import Gateway
from gateway.errors import error_body
from gateway.limits import HttpLimits
from services.rpc.config import ConfigError
from services.rpc.security import NONE, Security

KEEP_ALIVE_S = 75


@dataclass
class HttpServer:
    gateway: Gateway
    server: uvicorn.Server
    port: int

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.server.shutdown()
        await self.gateway.close()


async def start_http(coordinator_address: str, host: str, port: int,
                     max_message_bytes: int = 64 * 1024 * 1024, security: Security = NONE,
                     own_token: str | None = None, tls_files: tuple[str, str] | None = None,
                     limits: HttpLimits = HttpLimits(), peers: tuple[str, ...] = (),
                     resume_s: float = 0.0) -> HttpServer:
    """`security`/`own_token`: see gateway.app.Gateway (the coordinator's TLS and API tokens);
    `tls_files`: (certificate, key) PEM files: serve HTTPS (the coordinator's own certificate);
    `peers`: other coordinators a broken stream Resumes on, for up to `resume_s` (gateway/resume.py)."""
    if limits.max_body_bytes >= max_message_bytes:
        raise ConfigError(f"AERIE_HTTP_MAX_BODY_BYTES ({limits.max_body_bytes}) must be below the gRPC message "
                          f"limit AERIE_MAX_MESSAGE_BYTES ({max_message_bytes}) that a request travels in")
    gateway = Gateway(coordinator_address, max_message_bytes, security, own_token, limits, peers, resume_s)
    await gateway.open()
    # keep-alive: uvicorn's 5 s default closes idle connections that clients (the openai SDK's pool)
    # are about to reuse, and the request racing the close fails; 75 s outlasts common client pools.
    config = uvicorn.Config(_head_limit(gateway.app(), limits.max_header_bytes), host=host, port=port, log_level="warning", lifespan="off",
                            access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                            http=limited_protocol(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
                            ssl_certfile=tls_files[0] if tls_files else None,
                            ssl_keyfile=tls_files[1] if tls_files else None)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    if not server.started:
        raise OSError(f"the HTTP API cannot listen on {host}:{port}")
    bound = server.servers[0].sockets[0].getsockname()[1]
    return HttpServer(gateway, server, int(bound))


def limited_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the per-peer connection limit and a 431 for an oversized head
    (one class per server: it holds that server's connection counts)."""
    open_per_peer: dict[str, int] = {}
    too_many = error_body(f"this client address has {limits.max_connections_per_peer} connections open, its limit "
                          f"(AERIE_HTTP_MAX_CONNECTIONS_PER_PEER): reuse them or close some", "rate_limit_error",
                          code="too_many_connections")

    async def refuse(scope, receive, send) -> None:
        body = json.dumps(too_many).encode()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    class LimitedH11Protocol(H11Protocol):
        _peer: str | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            limit = limits.max_connections_per_peer
            if limit and open_per_peer.get(host, 0) >= limit:
                self.app = refuse  # every request on this connection: 429, then the connection closes
                return
            self._peer = host
            open_per_peer[host] = open_per_peer.get(host, 0) + 1

        def connection_lost(self, exc) -> None:
            if self._peer is not None:
                left = open_per_peer.get(self._peer, 1) - 1
                if left > 0:
                    open_per_peer[self._peer] = left
                else:
                    open_per_peer.pop(self._peer, None)
                self._peer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if len(self.conn.trailing_data[0]) > limits.max_header_bytes:  # h11 stopped buffering the head
                self._send_431()
                return
            super().send_400_response(msg)

        def _send_431(self) -> None:
            body = json.dumps(_head_too_large(limits.max_header_bytes)).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return LimitedH11Protocol


def _head_too_large(limit: int) -> dict:
    return error_body(f"the request line and headers are larger than {limit} bytes, the most this server "
                      f"accepts (AERIE_HTTP_MAX_HEADER_BYTES)", "invalid_request_error",
                      code="request_header_fields_too_large")


def _head_limit(app, limit: int):
    """The ASGI app behind a 431 for a request head over `limit` bytes (as sent: request line, and
    "name: value" + CRLF per header)."""
    body = json.dumps(_head_too_large(limit)).encode()

    async def limited(scope, receive, send) -> None:
        if scope["type"] == "http":
            size = len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
            size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > limit:
                await send({"type": "http.response.start", "status": 431,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return limited
