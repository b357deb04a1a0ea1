"""Cross-cutting gRPC state: the W3C trace context travels in call metadata.

`ClientTracing` (sync channels) adds `traceparent` for the caller's current span; `ServerTracing`
(grpc.aio servers) opens a SERVER span under it for the duration of the call, so one request's spans
from the coordinator, drafter and verifier form one trace. Both do nothing when tracing is off
(`telemetry.enabled()` is False) or the call carries no trace context (health probes).
"""

from __future__ import annotations

import collections

import grpc

from services import telemetry


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _ClientDetails(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """A client interceptor that rewrites every call's details (`_details`), whatever its kind."""

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return d  # subclasses add their metadata

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class ClientTracing(_ClientDetails):
    @staticmethod
    def _details(d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        if not telemetry.enabled():
            return d
        metadata = list(d.metadata or ())
        telemetry.inject(metadata)
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)


class ServerTracing(grpc.aio.ServerInterceptor):
    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not telemetry.enabled():
            return handler
        parent = telemetry.extract(handler_call_details.invocation_metadata)
        if parent is None:
            return handler
        method = handler_call_details.method.lstrip("/")  # "aerie.v1.Verifier/Verify"
        attributes = {telemetry.SERVICE: self.service, "rpc.system": "grpc", "rpc.method": method}
        return _traced(handler, lambda: telemetry.begin_span(method, parent, "server", attributes))


def _traced(handler: grpc.RpcMethodHandler, new_span) -> grpc.RpcMethodHandler:
    """The same handler with every call wrapped in a span (ended however the call ends). The span is
    the current one while the handler runs. grpc.aio tells streaming handlers from unary ones by
    their function type, so each wrapper is a real coroutine / async generator function."""
    des, ser = handler.request_deserializer, handler.response_serializer
    inner = handler.unary_unary or handler.stream_unary or handler.unary_stream or handler.stream_stream

    async def unary(request, context):
        span = new_span()
        try:
            with telemetry.use_span(span):
                return await inner(request, context)
        except Exception as e:
            telemetry.record_error(span, e)
            raise
        finally:
            span.end()

    async def stream(request, context):
        span = new_span()
        try:
            with telemetry.use_span(span):
                async for item in inner(request, context):
                    yield item
        except Exception as e:
            telemetry.record_error(span, e)
            raise
        finally:
            span.end()

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    return grpc.stream_stream_rpc_method_handler(stream, des, ser)


class _Undecodable:
    """Stands in for a request whose bytes are not a valid message of the method's type."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class ServerDecoding(grpc.aio.ServerInterceptor):
    """Undecodable request bytes get INVALID_ARGUMENT naming the method, not grpc's UNKNOWN
    "Unexpected DecodeError": the deserializer no longer raises; the handler aborts instead."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        des, ser = handler.request_deserializer, handler.response_serializer

        def lenient(data: bytes):
            try:
                return des(data)
            except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
                return _Undecodable(e)

        async def refuse(context, bad: _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request to {method} is not a valid message: {bad.error}")

        async def checked(requests, context):
            async for r in requests:
                if isinstance(r, _Undecodable):
                    await refuse(context, r)
                yield r

        if handler.unary_unary or handler.unary_stream:
            inner = handler.unary_unary or handler.unary_stream

            async def unary_in(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                return await inner(request, context)

            async def unary_in_stream_out(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                async for item in inner(request, context):
                    yield item

            if handler.unary_unary:
                return grpc.unary_unary_rpc_method_handler(unary_in, lenient, ser)
            return grpc.unary_stream_rpc_method_handler(unary_in_stream_out, lenient, ser)
        inner = handler.stream_unary or handler.stream_stream

        async def stream_in(requests, context):
            return await inner(checked(requests, context), context)

        async def stream_in_stream_out(requests, context):
            async for item in inner(checked(requests, context), context):
                yield item

        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(stream_in, lenient, ser)
        return grpc.stream_stream_rpc_method_handler(stream_in_stream_out, lenient, ser)


class ServerAuth(grpc.aio.ServerInterceptor):
    """Bearer tokens at a server's edge (services/rpc/security.py): every method but the health
    service needs `authorization: Bearer <token>` that is one of `accepted` (token -> identity);
    anything else is UNAUTHENTICATED before the handler runs or the request is decoded."""

    def __init__(self, accepted, what: str) -> None:
        self.accepted = accepted
        self.what = what  # "an internal token" / "an API token": named in the refusal

    async def intercept_service(self, continuation, handler_call_details):
        from services.rpc.security import HEALTH_PREFIX, bearer, token_identity

        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        token = bearer(handler_call_details.invocation_metadata)
        if token_identity(token, self.accepted) is not None:
            return handler
        message = (f"{handler_call_details.method} needs {self.what}: send 'authorization: Bearer <token>'"
                   if token is None else f"{handler_call_details.method}: the bearer token is not valid here")
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, message)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that aborts every call with (code, message) without reading it."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    keep = dict(request_deserializer=lambda data: None, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **keep)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **keep)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **keep)
    return grpc.stream_stream_rpc_method_handler(stream, **keep)


class ClientMetadata(_ClientDetails):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] != "authorization"] + [self.header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

