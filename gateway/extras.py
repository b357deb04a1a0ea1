"""The HTTP API's routes beyond completions (vLLM's, so its clients and scripts work unchanged) and
its JSON errors for unknown routes and methods:

    POST /tokenize      {"prompt": "..."} | {"messages": [...]}  -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize    {"tokens": [...]}                        -> {"prompt": "..."}
    GET  /version                                               -> {"version": "<aerie's version>"}
    GET  /openapi.json                                          -> the OpenAPI document (gateway/openai_schema.py)
    404 / 405           {"error": {"message": "Invalid URL (GET /v1/nothing)", "type": "invalid_request_error", ...}}

/tokenize applies the chat template exactly as a chat completion does, so its count is the prompt
length a chat completion would report. Both need the coordinator's tokenizer (a coordinator without
one answers 400). Their bodies are validated by the typed models (gateway/validation.py), as the completions'
are: a 400 names the field, its value and the reason; an unknown field is a 400 naming it.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import grpc
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.errors import error_body, from_rpc
from gateway import openai_schema
from gateway.validation import BadParameter, validated
from services.rpc.stubs import coordinator as cpb


def version() -> str:
    try:
        return importlib.metadata.version("aerie")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's 404 (no route) and 405 (a route without this method) in OpenAI's error shape."""
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = (f"method {request.method} is not allowed on {request.url.path}; "
                   f"allowed: {(exc.headers or {}).get('Allow', '?')}")
    else:
        message = exc.detail or f"HTTP {exc.status_code}"
    return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code,
                        headers=exc.headers)


def tokenize_request(body: Any) -> tuple[cpb.TokenizeRequest, bool]:
    """-> (the coordinator request, return_token_strs)."""
    req = validated(openai_schema.TokenizeRequest, body)
    if (req.prompt is None) == (req.messages is None):  # (the model types each; this rule spans two)
        raise BadParameter("prompt", "give exactly one of prompt and messages")
    msg = cpb.TokenizeRequest()
    if req.prompt is not None:
        msg.prompt = req.prompt
        if req.add_special_tokens is not None:
            msg.add_special_tokens = req.add_special_tokens
    for m in req.messages or ():
        msg.messages.append(cpb.ChatMessage(role=m.role, content=m.text()))
    return msg, bool(req.return_token_strs)


def detokenize_request(body: Any) -> cpb.DetokenizeRequest:
    return cpb.DetokenizeRequest(tokens=validated(openai_schema.DetokenizeRequest, body).tokens)


class Extras:
    """The handlers of /tokenize, /detokenize and /version over a gateway.app.Gateway."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    async def _call(self, request: Request, parse, method: str):
        """(parsed body, coordinator answer) or a JSONResponse error."""
        from gateway.app import HttpError  # (app imports this module)

        try:
            metadata = self.gateway._caller(request)
            body = await self.gateway.read_json(request, messages=method == "Tokenize")  # (the HTTP limits)
        except HttpError as e:
            return None, e.response()
        try:
            parsed = parse(body)
            info = await self.gateway._served(body.get("model"))
            msg = parsed[0] if isinstance(parsed, tuple) else parsed
            answer = await getattr(self.gateway.stub, method)(msg, metadata=metadata, timeout=30)
        except BadParameter as e:
            return None, JSONResponse(error_body(str(e), "invalid_request_error", e.param), status_code=400)
        except HttpError as e:
            return None, JSONResponse(e.body, status_code=e.status)
        except grpc.aio.AioRpcError as e:
            status, out = from_rpc(e)
            return None, JSONResponse(out, status_code=status)
        return (parsed, info), answer

    async def tokenize(self, request: Request) -> JSONResponse:
        ctx, answer = await self._call(request, tokenize_request, "Tokenize")
        if ctx is None:
            return answer
        (_, return_strs), info = ctx
        return JSONResponse({"count": len(answer.tokens), "max_model_len": info.max_context,
                             "tokens": list(answer.tokens),
                             "token_strs": list(answer.token_strs) if return_strs else None})

    async def detokenize(self, request: Request) -> JSONResponse:
        ctx, answer = await self._call(request, detokenize_request, "Detokenize")
        return answer if ctx is None else JSONResponse({"prompt": answer.text})

    async def version(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": version()})

    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(openai_schema.openapi(version()))
