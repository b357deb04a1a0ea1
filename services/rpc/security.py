"""Trust boundaries of the gRPC services (docs/security.md): TLS, mTLS, bearer tokens, identities.

    security = Security.load(config.service)            # reads the files named in the config
    server.add_secure_port(address, security.server_credentials(require_client_cert=True))
    channel = open_channel(address, limit, security)   # TLS + client certificate + internal token

Every control is optional, for local use (loopback, `aerie up`):

    TLS          AERIE_TLS_CERT + AERIE_TLS_KEY: the server's certificate chain and key (PEM files); the
                 same pair is the client certificate a coordinator presents to drafters / verifiers.
                 AERIE_TLS_CA: the CA that verifies peers; on a drafter or verifier it also makes the
                 server require a client certificate signed by it (mTLS: only coordinators hold one).
    internal     AERIE_INTERNAL_TOKEN_FILE (or AERIE_INTERNAL_TOKEN): a shared secret drafters and
                 verifiers require (`authorization: Bearer <token>`) and coordinators send.
    public API   AERIE_API_TOKENS_FILE: one `identity token` pair per line; the coordinator (gRPC and the
                 HTTP API) then requires `authorization: Bearer <token>` and the identity owns the
                 sequences it creates. Read again when the file changes (services/rpc/api_tokens.py).

The health service never needs a token (probes carry none, and it reveals nothing but SERVING).
Without API tokens every caller is the identity ANONYMOUS (so sequences are shared, as before); the
per-client concurrency limit then counts by peer host instead.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.errors import AerieError
from services.rpc.api_tokens import ApiTokens
from services.rpc.config import ConfigError

if TYPE_CHECKING:  # `--help` of every command imports this module: no grpc at import time
    import grpc

ANONYMOUS = "anonymous"  # the identity of every caller when the coordinator has no API tokens
HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTHORIZATION = "authorization"


class Unauthenticated(AerieError):
    """No or an unknown credential (UNAUTHENTICATED)."""


class PermissionDenied(AerieError):
    """An authenticated caller asked for something it may not do (PERMISSION_DENIED)."""


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} ({e.strerror})") from None


@dataclass(frozen=True)
class Security:
    """What one process uses at its trust boundaries (secrets are never in repr)."""

    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    internal_token: str | None = field(default=None, repr=False)  # drafters/verifiers require it; coordinators send it
    # token -> identity (coordinator, gateway): an ApiTokens read again when its file changes
    api_tokens: MutableMapping[str, str] = field(default_factory=dict, repr=False)
    client_token: str | None = field(default=None, repr=False)  # a public-API client's own bearer token
    server_name: str | None = None  # check peers' certificates against this name (pods are dialled by IP)

    @classmethod
    def load(cls, service) -> Security:
        """From a ServiceConfig's file names (and AERIE_INTERNAL_TOKEN in the environment)."""
        cert, key = _read(service.tls_cert, "AERIE_TLS_CERT"), _read(service.tls_key, "AERIE_TLS_KEY")
        if (cert is None) != (key is None):
            raise ConfigError("TLS needs both a certificate and its key (AERIE_TLS_CERT and AERIE_TLS_KEY)")
        token_file = _read(service.internal_token_file, "AERIE_INTERNAL_TOKEN_FILE")
        internal = (token_file.decode().strip() if token_file is not None else
                    os.environ.get("AERIE_INTERNAL_TOKEN", "").strip()) or None
        tokens = ApiTokens.from_file(service.api_tokens_file) if service.api_tokens_file else {}
        return cls(cert, key, _read(service.tls_ca, "AERIE_TLS_CA"), internal, tokens,
                   server_name=service.tls_server_name)

    @classmethod
    def client_from_env(cls) -> Security:
        """A public-API client (`aerie generate --coordinator`): AERIE_TLS_CA (and AERIE_TLS_CERT/KEY for
        a client certificate), AERIE_API_TOKEN."""
        return cls(_read(os.environ.get("AERIE_TLS_CERT"), "AERIE_TLS_CERT"),
                   _read(os.environ.get("AERIE_TLS_KEY"), "AERIE_TLS_KEY"),
                   _read(os.environ.get("AERIE_TLS_CA"), "AERIE_TLS_CA"),
                   client_token=os.environ.get("AERIE_API_TOKEN") or None,
                   server_name=os.environ.get("AERIE_TLS_SERVER_NAME") or None)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def client_tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials | None:
        """None = plaintext. A CA with `require_client_cert` = mTLS (drafters and verifiers)."""
        if not self.tls:
            return None
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert and self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.client_tls:
            return None
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def outgoing_token(self) -> str | None:
        """The bearer token this process sends: the internal one (coordinator -> services), else its own."""
        return self.internal_token or self.client_token


NONE = Security()


def bearer(metadata) -> str | None:
    for k, v in metadata or ():
        if k == AUTHORIZATION:
            value = v.decode() if isinstance(v, bytes) else v
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def token_identity(token: str | None, tokens: Mapping[str, str]) -> str | None:
    """The identity of `token` (compared in constant time with every known token), None if unknown."""
    if token is None:
        return None
    found = None
    for known, identity in tokens.items():
        if hmac.compare_digest(known.encode(), token.encode()):
            found = identity
    return found


def peer_host(peer: str) -> str:
    """'ipv4:127.0.0.1:5555' -> 'ipv4:127.0.0.1' ('ipv6:[::1]:5555' -> 'ipv6:[::1]'): a client's port
    changes with every connection, its host does not."""
    head, sep, tail = peer.rpartition(":")
    return head if sep and tail.isdigit() and head.count(":") >= 1 else peer


def redact(url: str) -> str:
    """A Redis (or any) URL without its password: what is printed and logged."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_password() -> dict[str, str]:
    """{"password": ...} from AERIE_REDIS_PASSWORD when set (the Helm chart passes the Secret's value
    there, so any character is safe: nothing has to be URL-encoded into AERIE_REDIS_URL), else {}."""
    password = os.environ.get("AERIE_REDIS_PASSWORD")
    return {"password": password} if password else {}
