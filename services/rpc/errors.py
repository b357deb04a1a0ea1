"""The one place that maps domain exceptions to gRPC status codes, both ways.

    InvalidRequest      -> INVALID_ARGUMENT    bad ids or parameters, malformed or oversize tensors,
                                               dtype or shape mismatch
    SequenceNotFound    -> NOT_FOUND           unknown sequence
    SequenceExists      -> ALREADY_EXISTS      a client-chosen sequence id already in use
    CapacityExceeded    -> RESOURCE_EXHAUSTED  over a configured capacity (sequences, prompt length, KV)
    CheckpointError     -> FAILED_PRECONDITION the service's own models are unusable
    GroupError          -> UNAVAILABLE         a tensor-parallel rank is gone or missed its deadline
    Unauthenticated     -> UNAUTHENTICATED     no or an unknown bearer token (services/rpc/security.py)
    PermissionDenied    -> PERMISSION_DENIED   a caller that may not do this
    DownstreamError     -> the downstream code (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...)
    anything else       -> INTERNAL            logged with its traceback

`rpc_errors` wraps every servicer method (unary or streaming, async) and is the only place a servicer
catches broadly. `DownstreamError.from_rpc` turns a failed call to a drafter or verifier into a domain
exception that names the peer, so the coordinator's client sees which service failed and how.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re

import grpc

from services.errors import (AerieError, CapacityExceeded, CheckpointError, GroupError, InvalidRequest,
                             SequenceNotFound)
from services.metrics import REQUESTS_FAILED
from services.rpc.security import PermissionDenied, Unauthenticated

log = logging.getLogger("aerie.rpc")
# trailing metadata of a refusal a client may retry later (a rate limit): seconds until it would pass
RETRY_AFTER = "retry-after"


class SequenceExists(InvalidRequest):
    """A client-chosen sequence id that is already in use (ALREADY_EXISTS)."""


class DownstreamError(AerieError):
    """A call from this service to another one failed; `code` is what that call ended with."""

    def __init__(self, code: grpc.StatusCode, message: str, lost_sequence: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.lost_sequence = lost_sequence  # the peer answered but no longer holds the sequence

    @classmethod
    def from_rpc(cls, e: grpc.RpcError, role: str, address: str) -> DownstreamError:
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        if code == grpc.StatusCode.NOT_FOUND:
            # the peer lost a sequence this coordinator placed there (restarted): retryable for the client
            return cls(grpc.StatusCode.UNAVAILABLE, f"{role} at {address} lost the sequence: {details}",
                       lost_sequence=True)
        if code == grpc.StatusCode.UNAVAILABLE:
            return cls(code, f"{role} at {address} is unavailable: {details}")
        if code == grpc.StatusCode.CANCELLED:
            # this process never cancels its downstream calls: the peer's server stopped with the
            # call in flight (a replica going away), which is what UNAVAILABLE means to the caller
            return cls(grpc.StatusCode.UNAVAILABLE, f"{role} at {address} cancelled the call in flight "
                                                    f"(its server stopped): {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return cls(code, f"{role} at {address} did not answer in time: {details}")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION):
            return cls(code, details)  # the peer's message names the offending value already
        return cls(code, f"{role} at {address}: {code.name}: {details}")


# an absolute path of two or more components ("/home/u/models/x.gguf", "/tmp/a/b"); gRPC method
# names ("/aerie.v1.Verifier/Verify", "/grpc.health.v1.Health/Check") are not paths
_PATH = re.compile(r"(?<![\w.:/])/(?!aerie\.v1\.|grpc\.)(?:[\w.@+~-]+/)+([\w.@+~-]*)")


def without_paths(message: str) -> str:
    """The message with every absolute filesystem path cut to its last component: no path on the
    serving machine leaves a server in an error (docs/security.md)."""
    return _PATH.sub(lambda m: m.group(1) or "<dir>", message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception raised while serving a call (paths cut by `without_paths`)."""
    code, message = _status_for(exc)
    return code, without_paths(message)


def _status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, DownstreamError):
        return exc.code, str(exc)
    if isinstance(exc, SequenceExists):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, SequenceNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, CapacityExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, CheckpointError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, GroupError):  # a tensor-parallel rank is gone: retry on another replica
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, service: str, method: str, exc: Exception):
    code, message = status_for(exc)
    REQUESTS_FAILED.labels(service, code.name).inc()
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    else:
        log.info("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message)


def rpc_errors(fn):
    """Decorate an async servicer method (coroutine or async generator): domain exceptions become
    their status code, anything unexpected INTERNAL. Cancellation and aborts pass through."""
    method = fn.__qualname__
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as e:  # noqa: BLE001 - the one broad catch at the edge
                await _abort(context, getattr(self, "SERVICE", "unknown"), method, e)
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - the one broad catch at the edge
            await _abort(context, getattr(self, "SERVICE", "unknown"), method, e)
    return unary
