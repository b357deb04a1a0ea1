"""Configuration every service shares, and the flag <-> AERIE_* environment convention.

Each flag's default is its environment variable when set, else the built-in default; a flag on the
command line wins over both. argparse applies the flag's `type` to a string default, so a malformed
variable fails like a malformed flag. The values end up in frozen dataclasses validated in
`__post_init__`; the Helm chart sets the same variables.

    common        AERIE_HOST, AERIE_LOG_LEVEL, AERIE_METRICS_PORT, AERIE_MAX_MESSAGE_BYTES, AERIE_DRAIN_S
    security      AERIE_TLS_CERT, AERIE_TLS_KEY, AERIE_TLS_CA, AERIE_INTERNAL_TOKEN_FILE (or
                  AERIE_INTERNAL_TOKEN), AERIE_API_TOKENS_FILE (coordinator): services/rpc/security.py
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from services.errors import AerieError

DTYPE_NAMES = ("bf16", "fp16", "fp32", "int8")  # the keys of services.engine.local.DTYPES, named without importing torch
# --dtype's accepted spellings (vLLM's and PyTorch's too) -> a DTYPE_NAMES key; auto -> None (the
# device's default: bf16 on a GPU, fp32 on the CPU, services/device.py)
DTYPE_ALIASES = {"auto": None, "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32",
                 "float": "fp32", "int8": "int8", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's own default
MESSAGE_OVERHEAD = 16 * 1024  # room for the non-tensor fields of a message carrying a tensor chunk


class ConfigError(AerieError, ValueError):
    """A flag or AERIE_* variable with a value the service cannot run with (exit code 2)."""


def dtype_flag(text: str) -> str | None:
    """--dtype's argparse type: a DTYPE_ALIASES spelling -> its DTYPE_NAMES key, None for auto."""
    key = text.strip().lower()
    if key not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"must be auto, bfloat16 (bf16), float16 (fp16, half), float32 (fp32) or "
                                         f"int8; got {text!r}")
    return DTYPE_ALIASES[key]


def endpoint_problem(entry: str) -> str | None:
    """Why `entry` is not HOST:PORT (an IPv6 host in brackets: `[::1]:50051`), or None when it is."""
    host, colon, port = entry.rpartition(":")
    if not colon or not host:
        return "not HOST:PORT"
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        return "not HOST:PORT (an IPv6 host goes in brackets: [::1]:50051)"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not a number in [1, 65535]"
    return None


def env(name: str, default: object = None) -> object:
    """The variable's raw string when set and non-empty, else `default` (argparse converts it)."""
    value = os.environ.get(name)
    return default if value is None or value == "" else value


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    host: str = "0.0.0.0"  # listen address of the gRPC server and the metrics endpoint
    port: int = 0  # 0 = any free port
    log_level: str = "INFO"
    metrics_port: int | None = None  # Prometheus /metrics; None = off, 0 = any free port
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest gRPC message sent or received
    drain_s: float = 20.0  # SIGTERM: seconds in-flight calls get to finish
    port_file: str | None = None  # write {"port", "metrics_port"} here once serving (`aerie up`)
    # trust boundaries (services/rpc/security.py): file names only, never the secrets themselves
    tls_cert: str | None = None  # PEM certificate chain of this server (and its client certificate)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # PEM CA verifying peers; drafters/verifiers then require client certificates
    internal_token_file: str | None = None  # shared secret between coordinators and drafters/verifiers
    api_tokens_file: str | None = None  # coordinator: `identity token` lines; the public API needs one
    tls_server_name: str | None = None  # the name peers' certificates are checked against (default: the address's host)
    health_port: int | None = None  # also serve only the health service, plaintext, here (probes that cannot do TLS)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535]; got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in [0, 65535]; got {self.metrics_port}")
        if self.max_message_bytes < 4 * MESSAGE_OVERHEAD:
            raise ConfigError(f"max_message_bytes must be >= {4 * MESSAGE_OVERHEAD}; got {self.max_message_bytes}")
        if logging.getLevelName(self.log_level.upper()) not in range(0, 60):
            raise ConfigError(f"log_level must be DEBUG, INFO, WARNING or ERROR; got {self.log_level!r}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ConfigError(f"health_port must be in [0, 65535]; got {self.health_port}")
        if self.drain_s < 0:
            raise ConfigError(f"drain_s must be >= 0; got {self.drain_s}")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def chunk_bytes(self) -> int:
        """Tensor bytes per streamed chunk, so that no message exceeds max_message_bytes."""
        return self.max_message_bytes - MESSAGE_OVERHEAD


def add_service_flags(p: argparse.ArgumentParser, port_env: str, default_port: int) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default=env("AERIE_HOST", "0.0.0.0"), help="listen address (AERIE_HOST)")
    g.add_argument("--port", type=int, default=env(port_env, default_port),
                   help=f"gRPC port, 0 = any free port ({port_env})")
    g.add_argument("--metrics-port", type=int, default=env("AERIE_METRICS_PORT"),
                   help="Prometheus /metrics port, 0 = any free port (AERIE_METRICS_PORT; default: off)")
    g.add_argument("--max-message-bytes", type=int,
                   default=env("AERIE_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES),
                   help="largest gRPC message in bytes (AERIE_MAX_MESSAGE_BYTES)")
    g.add_argument("--log-level", default=env("AERIE_LOG_LEVEL", "INFO"), help="DEBUG, INFO, WARNING or ERROR (AERIE_LOG_LEVEL)")
    g.add_argument("--drain-s", type=float, default=env("AERIE_DRAIN_S", 20.0),
                   help="seconds in-flight calls get after SIGTERM (AERIE_DRAIN_S)")
    g.add_argument("--port-file", default=None, help=argparse.SUPPRESS)
    t = p.add_argument_group("security (docs/security.md; all optional for local use)")
    t.add_argument("--tls-cert", default=env("AERIE_TLS_CERT"),
                   help="PEM certificate of this server, also its client certificate (AERIE_TLS_CERT; default: "
                        "plaintext)")
    t.add_argument("--tls-key", default=env("AERIE_TLS_KEY"), help="PEM key of --tls-cert (AERIE_TLS_KEY; default: none)")
    t.add_argument("--tls-ca", default=env("AERIE_TLS_CA"),
                   help="PEM CA that verifies peers; drafters and verifiers then require client certificates "
                        "signed by it (mTLS) (AERIE_TLS_CA; default: none)")
    t.add_argument("--tls-server-name", default=env("AERIE_TLS_SERVER_NAME"),
                   help="check the certificates of the drafters/verifiers this calls against this name instead of "
                        "the host of their address (AERIE_TLS_SERVER_NAME; default: the host; pods are dialled by IP)")
    t.add_argument("--health-port", type=int, default=env("AERIE_HEALTH_PORT"),
                   help="also serve the gRPC health service alone, plaintext, on this port, for probes that "
                        "cannot speak TLS (AERIE_HEALTH_PORT; default: off)")
    t.add_argument("--internal-token-file", default=env("AERIE_INTERNAL_TOKEN_FILE"),
                   help="file holding the token drafters/verifiers require and coordinators send "
                        "(AERIE_INTERNAL_TOKEN_FILE, or the token itself in AERIE_INTERNAL_TOKEN; default: none)")
    t.add_argument("--api-tokens-file", default=env("AERIE_API_TOKENS_FILE"),
                   help="coordinator: file of 'identity token' lines; the public API then needs a bearer token "
                        "(AERIE_API_TOKENS_FILE; default: open, every caller is 'anonymous')")


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(host=args.host, port=args.port, log_level=args.log_level.upper(),
                         metrics_port=args.metrics_port, max_message_bytes=args.max_message_bytes,
                         drain_s=args.drain_s, port_file=args.port_file, tls_cert=args.tls_cert,
                         tls_key=args.tls_key, tls_ca=args.tls_ca, internal_token_file=args.internal_token_file,
                         api_tokens_file=args.api_tokens_file, tls_server_name=args.tls_server_name,
                         health_port=args.health_port)


def configure_logging(level: str, service: str) -> None:
    """key=value log lines on stderr, one per event."""
    logging.basicConfig(level=level.upper(),
                        format=f"ts=%(asctime)s level=%(levelname)s service={service} logger=%(name)s msg=%(message)s")
