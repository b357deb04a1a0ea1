"""Client channels: message-size limits, the tracing interceptor, and retries.

Retries live in the service config and only for UNAVAILABLE on calls that are idempotent: Draft, DraftAhead,
Verify and Decode (each keyed by (sequence_id, round_index) on the server), Release and GetInfo.
Prefill is never retried (a second one finds the sequence already there). Callers always pass a
deadline (`timeout=`) per call.
"""

from __future__ import annotations

import json

import grpc

from services.rpc.interceptors import ClientMetadata, ClientTracing
from services.rpc.security import NONE, Security
from services.rpc.server import message_options

_RETRIED = [("aerie.v1.Drafter", m) for m in ("Draft", "DraftAhead", "Release", "GetInfo")] + \
           [("aerie.v1.Verifier", m) for m in ("Verify", "Decode", "Release", "GetInfo")] + \
           [("aerie.v1.Coordinator", m) for m in ("GetSequence", "Cancel")]
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": s, "method": m} for s, m in _RETRIED],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]})


def open_channel(address: str, max_message_bytes: int, security: Security = NONE) -> grpc.Channel:
    """A channel with TLS when `security` has a CA or certificate (its certificate is then the client
    certificate), and its bearer token on every call (services/rpc/security.py)."""
    options, credentials = _options(max_message_bytes, security)
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(address, options=options))
    token = security.outgoing_token()
    interceptors = [ClientTracing()] + ([ClientMetadata(token)] if token else [])
    return grpc.intercept_channel(channel, *interceptors)


def open_aio_channel(address: str, max_message_bytes: int, security: Security = NONE) -> grpc.aio.Channel:
    """`open_channel` for a caller on an asyncio event loop (a verifier calling a drafter,
    verifier_svc/direct_draft.py): the same options and credentials; the bearer token is the
    caller's to send (`call_metadata`), and no tracing interceptor."""
    options, credentials = _options(max_message_bytes, security)
    return (grpc.aio.secure_channel(address, credentials, options=options) if credentials is not None
            else grpc.aio.insecure_channel(address, options=options))


def call_metadata(security: Security) -> tuple[tuple[str, str], ...]:
    """The metadata a call of `open_aio_channel`'s carries: the bearer token, if any."""
    token = security.outgoing_token()
    return (("authorization", f"Bearer {token}"),) if token else ()


def _options(max_message_bytes: int, security: Security) -> tuple[list, grpc.ChannelCredentials | None]:
    options = [*message_options(max_message_bytes), ("grpc.service_config", SERVICE_CONFIG),
               ("grpc.enable_retries", 1),
               # a replica that restarts (or a pod that replaces it at the same address) is reached
               # again within ~2 s rather than after gRPC's default backoff of up to 120 s
               ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 2000)]
    credentials = security.channel_credentials()
    if credentials is not None and security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    return options, credentials
