"""The one place the HTTP API maps failures to HTTP statuses and OpenAI's error shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

    gRPC INVALID_ARGUMENT / OUT_OF_RANGE   -> 400 invalid_request_error  (a BadParameter too)
    UNAUTHENTICATED                        -> 401 authentication_error   (no or an unknown API key)
    PERMISSION_DENIED                      -> 403 permission_error
    NOT_FOUND                              -> 404 not_found_error        (unknown model or sequence)
    ALREADY_EXISTS                         -> 409 conflict_error
    RESOURCE_EXHAUSTED / UNAVAILABLE       -> 503 service_unavailable    (no capacity, no replica;
                                                                          RESOURCE_EXHAUSTED with Retry-After)
    RESOURCE_EXHAUSTED + `retry-after`     -> 429 rate_limit_error       (a client over the coordinator's rate;
                                                                          Retry-After its own wait)
    DEADLINE_EXCEEDED                      -> 504 timeout_error
    CANCELLED                              -> 499 client_closed_request  (the client went away)
    anything else                          -> 500 internal_error
"""

from __future__ import annotations

import math

import grpc

from services.rpc.errors import RETRY_AFTER

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


# The coordinator's INVALID_ARGUMENT messages that concern one OpenAI field: (words in the message,
# param). `max_new_tokens` is the coordinator's word; the body's own name replaces it.
_PARAMS = (("exceeds the model context", "{max_tokens}"), ("max_new_tokens", "{max_tokens}"),
           ("stop token id", "stop_token_ids"), ("prompt token id", "prompt"), ("prompt is empty", "prompt"),
           ("chat template", "messages"), ("stop string", "stop"), ("stop may hold", "stop"), ("stop[", "stop"))


def name_param(status: int, body: dict, max_tokens_param: str = "max_tokens") -> tuple[int, dict]:
    """A coordinator's 400 in OpenAI's words: `param` names the request field it concerns and the
    message uses the field's OpenAI name (max_tokens, not max_new_tokens)."""
    err = body["error"]
    if status != 400 or err.get("param") is not None:
        return status, body
    message = err["message"]
    for words, param in _PARAMS:
        if words in message:
            err["param"] = param.format(max_tokens=max_tokens_param)
            break
    err["message"] = message.replace("max_new_tokens", max_tokens_param)
    if "exceeds the model context" in message:
        err["code"] = "context_length_exceeded"  # OpenAI's code for it
    return status, body


RETRY_AFTER_S = 1  # a request refused for capacity (a full admission queue, its timeout): try again this soon


def _rate_limited_s(e: grpc.RpcError) -> float | None:
    """The seconds a rate-limited refusal names (its `retry-after` trailing metadata), else None."""
    if not hasattr(e, "trailing_metadata") or (e.code() if hasattr(e, "code") else None) != \
            grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def retry_after(e: grpc.RpcError) -> dict[str, str] | None:
    """The Retry-After header of a capacity refusal (RESOURCE_EXHAUSTED): a rate limit's own wait
    (whole seconds, rounded up), else RETRY_AFTER_S; None for anything else."""
    code = e.code() if hasattr(e, "code") else None
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    wait_s = _rate_limited_s(e)
    return {"Retry-After": str(RETRY_AFTER_S if wait_s is None else max(1, math.ceil(wait_s)))}


def from_rpc(e: grpc.RpcError) -> tuple[int, dict]:
    """(HTTP status, body) for a failed Coordinator call."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    if _rate_limited_s(e) is not None:  # OpenAI's 429 for a client over its rate
        return 429, error_body(details, "rate_limit_error", code="rate_limit_exceeded")
    status, type_ = STATUS.get(code, (500, "internal_error"))
    return status, error_body(details, type_, code=code.name)
