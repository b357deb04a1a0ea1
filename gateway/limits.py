"""What one HTTP client may make the gateway hold, each refused with a precise status before the
work it would cost:

    AERIE_HTTP_MAX_BODY_BYTES            (1 MiB)  a larger body -> 413; a Content-Length over it is
                                                  refused before one byte of the body is read, a
                                                  chunked body once it passes the limit
    AERIE_HTTP_MAX_HEADER_BYTES         (16 KiB)  request line + headers -> 431 (the HTTP parser
                                                  buffers no more than this)
    AERIE_HTTP_MAX_MESSAGES               (1024)  messages in one chat request -> 400 naming `messages`
    AERIE_HTTP_MAX_CONNECTIONS_PER_PEER     (64)  open connections from one client address -> the
                                                  next one's request gets 429 and is closed; 0 = no limit

The body limit also keeps a request under the gRPC message limit the gateway's Generate call
travels in (AERIE_MAX_MESSAGE_BYTES): a body past that would fail as 503, not as the 413 it is.
This module holds the limits and the body reader; gateway/server.py applies the header and
connection limits in the HTTP protocol, gateway/app.py the body and message limits.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.rpc.config import ConfigError, env


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10
    max_messages: int = 1024
    max_connections_per_peer: int = 64  # 0 = no limit

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024; got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be >= 1024; got {self.max_header_bytes}")
        if self.max_messages < 1:
            raise ConfigError(f"max_messages must be >= 1; got {self.max_messages}")
        if self.max_connections_per_peer < 0:
            raise ConfigError(f"max_connections_per_peer must be >= 0 (0 = no limit); "
                              f"got {self.max_connections_per_peer}")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP limits (the OpenAI-compatible API)")
    g.add_argument("--http-max-body-bytes", type=int, default=env("AERIE_HTTP_MAX_BODY_BYTES", 1 << 20),
                   help="largest request body; more is 413 before the body is read (AERIE_HTTP_MAX_BODY_BYTES, 1 MiB)")
    g.add_argument("--http-max-header-bytes", type=int, default=env("AERIE_HTTP_MAX_HEADER_BYTES", 16 << 10),
                   help="largest request line + headers; more is 431 (AERIE_HTTP_MAX_HEADER_BYTES, 16 KiB)")
    g.add_argument("--http-max-messages", type=int, default=env("AERIE_HTTP_MAX_MESSAGES", 1024),
                   help="most messages in one chat request; more is 400 (AERIE_HTTP_MAX_MESSAGES, 1024)")
    g.add_argument("--http-max-connections-per-peer", type=int, default=env("AERIE_HTTP_MAX_CONNECTIONS_PER_PEER", 64),
                   help="open connections from one client address; the next one gets 429 "
                        "(AERIE_HTTP_MAX_CONNECTIONS_PER_PEER, 64; 0 = no limit)")


def from_args(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(args.http_max_body_bytes, args.http_max_header_bytes, args.http_max_messages,
                      args.http_max_connections_per_peer)


class BodyTooLarge(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)


async def read_body(request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (BodyTooLarge otherwise: from the Content-Length
    before anything is read, else as soon as the streamed body passes the limit)."""
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise BodyTooLarge(f"the request body has {int(length)} bytes; this server accepts at most {limit} "
                           f"(AERIE_HTTP_MAX_BODY_BYTES)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is larger than {limit} bytes, the most this server accepts "
                               f"(AERIE_HTTP_MAX_BODY_BYTES)")
        chunks.append(chunk)
    return b"".join(chunks)
