"""The one place the HTTP API maps failures to HTTP statuses and OpenAI's error shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

    gRPC INVALID_ARGUMENT / OUT_OF_RANGE   -> 400 invalid_request_error  (a BadParameter too)
    UNAUTHENTICATED                        -> 401 authentication_error   (no or an unknown API key)
    PERMISSION_DENIED                      -> 403 permission_error
    NOT_FOUND                              -> 404 not_found_error        (unknown model or sequence)
    ALREADY_EXISTS                         -> 409 conflict_error
    RESOURCE_EXHAUSTED / UNAVAILABLE       -> 503 service_unavailable    (no capacity, no replica)
    DEADLINE_EXCEEDED                      -> 504 timeout_error
    CANCELLED                              -> 499 client_closed_request  (the client went away)
    anything else                          -> 500 internal_error
"""

from __future__ import annotations

import grpc

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "service_unavailable"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "client_closed_request"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def from_rpc(e: grpc.RpcError) -> tuple[int, dict]:
    """(HTTP status, body) for a failed Coordinator call."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    status, type_ = STATUS.get(code, (500, "internal_error"))
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    return status, error_body(details, type_, code=code.name)
