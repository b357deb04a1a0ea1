"""Configuration every service shares, and the flag <-> AERIE_* environment convention.

Each flag's default is its environment variable when set, else the built-in default; a flag on the
command line wins over both. argparse applies the flag's `type` to a string default, so a malformed
variable fails like a malformed flag. The values end up in frozen dataclasses validated in
`__post_init__`; the Helm chart sets the same variables.

    common        AERIE_HOST, AERIE_LOG_LEVEL, AERIE_METRICS_PORT, AERIE_MAX_MESSAGE_BYTES, AERIE_DRAIN_S
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from services.errors import AerieError

DTYPE_NAMES = ("bf16", "fp32", "int8")  # the keys of services.engine.local.DTYPES, named without importing torch
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's own default
MESSAGE_OVERHEAD = 16 * 1024  # room for the non-tensor fields of a message carrying a tensor chunk


class ConfigError(AerieError, ValueError):
    """A flag or AERIE_* variable with a value the service cannot run with (exit code 2)."""


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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535]; got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in [0, 65535]; got {self.metrics_port}")
        if self.max_message_bytes < 4 * MESSAGE_OVERHEAD:
            raise ConfigError(f"max_message_bytes must be >= {4 * MESSAGE_OVERHEAD}; got {self.max_message_bytes}")
        if logging.getLevelName(self.log_level.upper()) not in range(0, 60):
            raise ConfigError(f"log_level must be DEBUG, INFO, WARNING or ERROR; got {self.log_level!r}")
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


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(host=args.host, port=args.port, log_level=args.log_level.upper(),
                         metrics_port=args.metrics_port, max_message_bytes=args.max_message_bytes,
                         drain_s=args.drain_s, port_file=args.port_file)


def configure_logging(level: str, service: str) -> None:
    """key=value log lines on stderr, one per event."""
    logging.basicConfig(level=level.upper(),
                        format=f"ts=%(asctime)s level=%(levelname)s service={service} logger=%(name)s msg=%(message)s")
