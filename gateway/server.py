"""Serve the HTTP API with uvicorn inside an already running asyncio loop (the coordinator's, or a
test's), next to the gRPC server:

    http = await start_http("127.0.0.1:50051", host="0.0.0.0", port=8000)   # port 0 = any free port
    http.port
    await http.stop()

Uvicorn's `startup` / `shutdown` are used instead of `serve`, so it installs no signal handlers: the
coordinator's own SIGTERM handling drains gRPC first, then stops this.
"""

from __future__ import annotations

from dataclasses import dataclass

import uvicorn

from gateway.app import Gateway
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
                     own_token: str | None = None, tls_files: tuple[str, str] | None = None) -> HttpServer:
    """`security`/`own_token`: see gateway.app.Gateway (the coordinator's TLS and API tokens);
    `tls_files`: (certificate, key) PEM files: serve HTTPS (the coordinator's own certificate)."""
    gateway = Gateway(coordinator_address, max_message_bytes, security, own_token)
    await gateway.open()
    # keep-alive: uvicorn's 5 s default closes idle connections that clients (the openai SDK's pool)
    # are about to reuse, and the request racing the close fails; 75 s outlasts common client pools.
    config = uvicorn.Config(gateway.app(), host=host, port=port, log_level="warning", lifespan="off",
                            access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
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
