"""The exit codes of every `aerie` command, defined once (documented in docs/cli.md).

    0    success
    1    the work failed after it started: a server answered with an error, a service of `aerie up`
         or `aerie serve` died, a request ran out of capacity
    2    usage: a bad flag, value, input, configuration or checkpoint (argparse's own code too)
    3    model unavailable: a model or draft-head path that does not exist, a Hugging Face Hub id that
         is neither cached nor downloadable (offline, unknown, gated)
    4    server unreachable: connection refused, timed out, the server UNAVAILABLE
    130  interrupted (Ctrl-C)

A leaf module: no grpc or httpx import (a RemoteError is told by its status code's name).
"""

from __future__ import annotations

from services.errors import AerieError, CheckpointError, InvalidRequest, ModelUnavailable, Unreachable

OK = 0
FAILED = 1
USAGE = 2
MODEL_UNAVAILABLE = 3
UNREACHABLE = 4
INTERRUPTED = 130

UNREACHABLE_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # gRPC codes that mean "no server answered"
USAGE_STATUSES = ("INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION")  # the server refused the input


def exit_code(error: BaseException) -> int:
    """The exit code for an error that ends a command."""
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(error, ModelUnavailable):
        return MODEL_UNAVAILABLE
    if isinstance(error, Unreachable):
        return UNREACHABLE
    status = getattr(getattr(error, "code", None), "name", None)  # services.rpc RemoteError: a grpc.StatusCode
    if status in UNREACHABLE_STATUSES:
        return UNREACHABLE
    if status in USAGE_STATUSES:
        return USAGE
    if status is not None:
        return FAILED
    if isinstance(error, (InvalidRequest, CheckpointError, ValueError)):  # ConfigError is a ValueError
        return USAGE
    if isinstance(error, AerieError):
        return FAILED
    raise TypeError(f"not an aerie error: {type(error).__name__}")
