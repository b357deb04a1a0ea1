"""`aerie gateway`: the OpenAI-compatible HTTP API as a process of its own, in front of several
coordinators, so an HTTP stream outlives the coordinator it runs on (gateway/resume.py):

    aerie gateway --coordinators 10.0.0.5:50051,10.0.0.6:50051 --http-port 8000

New requests go to the first coordinator; one that is unavailable before a request's first message
passes the request (same sequence id) to the next. A stream whose coordinator dies or drains goes on
through Resume on the others for up to --resume-s. `aerie coordinator --http-port` still serves the same API inside the coordinator's process,
where a kill -9 of that process ends its HTTP streams.

With API tokens on the coordinators, give the gateway the same --api-tokens-file (it refuses callers
without a valid token before any call; the coordinators check the token again and own the sequence
by its identity) and AERIE_API_TOKEN, the token of its own calls (GetInfo for /health, the model name).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from aerie_cli.flags import add_command
from gateway import limits as http_limits
from services.rpc.config import DEFAULT_MAX_MESSAGE_BYTES, ConfigError, env


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "gateway", "serve the OpenAI-compatible HTTP API in front of coordinators", __doc__)
    g = p.add_argument_group("gateway")
    g.add_argument("--coordinators", default=env("AERIE_COORDINATORS", ""),
                   help="HOST:PORT list of coordinators; a broken stream Resumes on the others (AERIE_COORDINATORS)")
    g.add_argument("--host", default=env("AERIE_HOST", "0.0.0.0"), help="listen address (AERIE_HOST)")
    g.add_argument("--http-port", type=int, default=env("AERIE_HTTP_PORT", 8000),
                   help="HTTP port, 0 = any free port (AERIE_HTTP_PORT)")
    g.add_argument("--resume-s", type=float, default=env("AERIE_RESUME_S", 60.0),
                   help="how long a broken stream keeps trying to Resume on the coordinators (AERIE_RESUME_S)")
    g.add_argument("--max-message-bytes", type=int, default=env("AERIE_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES),
                   help="largest gRPC message to or from a coordinator (AERIE_MAX_MESSAGE_BYTES)")
    g.add_argument("--log-level", default=env("AERIE_LOG_LEVEL", "INFO"), help="(AERIE_LOG_LEVEL)")
    g.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    t = p.add_argument_group("security (docs/security.md)")
    t.add_argument("--tls-cert", default=env("AERIE_TLS_CERT"),
                   help="serve HTTPS with this PEM certificate, and reach the coordinators over TLS (AERIE_TLS_CERT; "
                        "default: plaintext)")
    t.add_argument("--tls-key", default=env("AERIE_TLS_KEY"), help="PEM key of --tls-cert (AERIE_TLS_KEY; default: none)")
    t.add_argument("--tls-ca", default=env("AERIE_TLS_CA"), help="CA of the coordinators' certificates (AERIE_TLS_CA; default: --tls-cert itself)")
    t.add_argument("--tls-server-name", default=env("AERIE_TLS_SERVER_NAME"),
                   help="the name the coordinators' certificates are checked against (AERIE_TLS_SERVER_NAME; "
                        "default: localhost)")
    t.add_argument("--api-tokens-file", default=env("AERIE_API_TOKENS_FILE"),
                   help="the coordinators' API tokens: callers without one get 401 here (AERIE_API_TOKENS_FILE; "
                        "default: none, the coordinators check the caller's token)")
    http_limits.add_flags(p)
    p.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server import start_http
    from services.rpc.config import configure_logging
    from services.rpc.coordinator_client import parse_addresses
    from services.rpc.security import Security
    from services.rpc.server import write_port_file
    from services.errors import InvalidRequest

    try:
        coordinators = parse_addresses(args.coordinators, "--coordinators")
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None
    limits = http_limits.from_args(args)
    security = Security.load(argparse.Namespace(
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
        internal_token_file=None, api_tokens_file=args.api_tokens_file))
    own_token = os.environ.get("AERIE_API_TOKEN") or None
    if security.api_tokens and own_token is None:
        raise ConfigError("with --api-tokens-file the gateway needs AERIE_API_TOKEN, one of those tokens, for its "
                          "own calls (GetInfo for /health and the model name)")
    configure_logging(args.log_level, "gateway")

    async def run() -> None:
        http = await start_http(coordinators[0], args.host, args.http_port, args.max_message_bytes, security,
                                own_token, (args.tls_cert, args.tls_key) if args.tls_cert else None, limits,
                                peers=coordinators[1:], resume_s=args.resume_s)
        if args.port_file:
            write_port_file(args.port_file, http_port=http.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await http.stop()

    asyncio.run(run())
    return 0
