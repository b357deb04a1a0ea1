"""The OpenAI-compatible HTTP API (Starlette), a client of the Coordinator's gRPC contract:

    POST /v1/completions         prompt (text or token ids) -> text; stream=true as SSE ending "data: [DONE]"
    POST /v1/chat/completions    messages (chat template on the coordinator) -> an assistant message
    GET  /v1/models              the served model, once per --served-model-name
    GET  /health                 200 when a verifier (and, unless plain decoding, a drafter) answers
    GET  /metrics                Prometheus text of this process (the coordinator's metrics)
    POST /tokenize, /detokenize  vLLM's, with the coordinator's tokenizer; GET /version, /openapi.json (gateway/extras.py)
    404 / 405                    JSON in OpenAI's error shape, like every other error

With API tokens (services/rpc/security.py) every route but /health and /metrics needs
`Authorization: Bearer <token>` (401 otherwise); the header travels on to the coordinator, which
checks it again and makes its identity the owner of the sequence. The gateway's own calls (GetInfo
for /health and the model name) use a token only this process knows (identity "gateway").

What one client may make the gateway hold is bounded (gateway/limits.py): the body (413, refused
from its Content-Length before it is read), the request head (431), the messages of a chat (400) and
the connections per client address (429).

Each choice of a request (its n, and on /v1/completions a batch of prompts) is one Coordinator.Generate
call, all of them at once; with `peers` (other coordinators: `aerie gateway
--coordinators A,B`, a process of its own) a stream whose coordinator dies or drains goes on through
Resume on another one (gateway/resume.py), so the HTTP client sees one unbroken answer. The first message (the prefill's) is read before the
HTTP answer starts, so a refused request gets its real status (gateway/errors.py) and nothing is
committed. A client that disconnects cancels the call, which cancels the sequence after its round in
flight (its KV is released on both services).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.errors import error_body, from_rpc, name_param, retry_after
from gateway.extras import Extras, http_error
from gateway.limits import BodyTooLarge, HttpLimits, read_body
from gateway.openai_logprobs import chat_logprobs, completion_logprobs, echo_logprobs, vllm_prompt_logprobs
from gateway.openai_request import Parsed, check_limits, parse_chat, parse_completion, with_defaults
from gateway.resume import ResumingCall
from gateway.validation import BadParameter
from services.rpc.forwarded import FORWARDED_FOR
from services.rpc.security import NONE, Security, token_identity
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc

log = logging.getLogger("aerie.http")
FINISH = {"stop": "stop", "length": "length", "cancel": "cancel"}  # services.engine.engine.FinishReason
INFO_TIMEOUT_S = 10.0


class HttpError(Exception):
    def __init__(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def _error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


def _closed() -> JSONResponse:
    return _error(499, error_body("the client closed the request: its sequence was cancelled", "client_closed_request"))


class Gateway:
    def __init__(self, coordinator_address: str, max_message_bytes: int = 64 * 1024 * 1024,
                 security: Security = NONE, own_token: str | None = None, limits: HttpLimits = HttpLimits(),
                 peers: tuple[str, ...] = (), resume_s: float = 0.0) -> None:
        """`security`: the coordinator's (its API tokens, its TLS certificate / CA to reach it);
        `own_token`: the token of the gateway's own calls (one of the coordinator's API tokens);
        `peers`: other coordinators a broken stream Resumes on, for up to `resume_s` (0 = never: the
        gateway inside a coordinator, which dies with it, ends a broken stream at once)."""
        self.limits = limits
        self.peers = peers
        self.resume_s = resume_s
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[coordinator_grpc.CoordinatorStub] = []
        self.address = coordinator_address
        self.max_message_bytes = max_message_bytes
        self.security = security
        self._own = (("authorization", f"Bearer {own_token}"),) if own_token else None
        self.channel: grpc.aio.Channel | None = None
        self.stub: coordinator_grpc.CoordinatorStub | None = None
        self._info: cpb.CoordinatorInfo | None = None  # kept once a verifier has named the model

    async def open(self) -> None:
        """Open the channel on the running loop (grpc.aio channels belong to one loop)."""
        opts = [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]
        if self.security.tls:  # reach the coordinator's TLS port, checking its own certificate
            creds = grpc.ssl_channel_credentials(root_certificates=self.security.ca or self.security.cert)
            opts.append(("grpc.ssl_target_name_override", self.security.server_name or "localhost"))
            self.channels = [grpc.aio.secure_channel(a, creds, options=opts) for a in (self.address, *self.peers)]
        else:
            self.channels = [grpc.aio.insecure_channel(a, options=opts) for a in (self.address, *self.peers)]
        self.channel = self.channels[0]
        self.stubs = [coordinator_grpc.CoordinatorStub(ch) for ch in self.channels]
        self.stub = self.stubs[0]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    def app(self) -> Starlette:
        extras = Extras(self)
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/tokenize", extras.tokenize, methods=["POST"]),
            Route("/detokenize", extras.detokenize, methods=["POST"]),
            Route("/version", extras.version, methods=["GET"]),
            Route("/openapi.json", extras.openapi, methods=["GET"]),
        ], exception_handlers={HTTPException: http_error})

    # ---- coordinator info ----------------------------------------------------------------------

    async def info(self, fresh: bool = False) -> cpb.CoordinatorInfo:
        if self._info is not None and not fresh:
            return self._info
        for i, stub in enumerate(self.stubs):  # the first coordinator that answers (peers: any of them)
            try:
                info = await stub.GetInfo(pb.InfoRequest(), timeout=INFO_TIMEOUT_S, metadata=self._own)
                break
            except grpc.aio.AioRpcError as e:
                if i == len(self.stubs) - 1 or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise HttpError(*from_rpc(e)) from None
        if info.verifiers_ready > 0:
            self._info = info
        return info

    async def _served(self, model: str | None) -> cpb.CoordinatorInfo:
        info = self._info or await self.info()
        if not info.model:
            raise HttpError(503, error_body("no verifier answers yet: the served model is unknown",
                                            "service_unavailable"))
        names = [info.model, *info.model_aliases]
        if model is not None and model not in (*names, info.target):
            served = " or ".join(repr(n) for n in names)
            raise HttpError(404, error_body(f"the model {model!r} does not exist; this server serves {served}",
                                            "not_found_error", "model", "model_not_found"))
        return info

    # ---- routes --------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            info = await self.info(fresh=True)
        except HttpError as e:
            return _error(503, e.body)
        ok = info.verifiers_ready > 0 and (info.drafters_configured == 0 or info.drafters_ready > 0)
        body = {"status": "ok" if ok else "unavailable", "verifiers_ready": info.verifiers_ready,
                "drafters_ready": info.drafters_ready, "drafters_configured": info.drafters_configured}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def _caller(self, request: Request) -> tuple[tuple[str, str], ...] | None:
        """The caller's Authorization header as gRPC metadata (without API tokens also its address,
        `aerie-forwarded-for`); HttpError 401 when the coordinator has API tokens and the header holds
        none of them."""
        header = request.headers.get("authorization")
        if not self.security.api_tokens:  # callers are counted by host: name this one (services/rpc/forwarded.py)
            forwarded = ((FORWARDED_FOR, request.client.host),) if request.client else ()
            return ((("authorization", header),) if header else ()) + forwarded or None
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or token_identity(token.strip(), self.security.api_tokens) in (None, "gateway"):
            raise HttpError(401, error_body("a valid API key is required: send 'Authorization: Bearer <token>'",
                                            "authentication_error", code="invalid_api_key"))
        return (("authorization", f"Bearer {token.strip()}"),)

    async def models(self, request: Request) -> Response:
        try:
            self._caller(request)
            info = await self._served(None)
        except HttpError as e:
            return _error(e.status, e.body)
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "aerie", "root": info.target,
            "max_model_len": info.max_context, "max_tokens": info.max_new_tokens}
            for name in (info.model, *info.model_aliases)]})  # every --served-model-name, as vLLM lists them

    async def read_json(self, request: Request, messages: bool) -> Any:
        """The request's JSON body under the HTTP limits (gateway/limits.py), or HttpError: 413 over
        the body limit (the rest of the body is never read: the connection closes), 400 not JSON,
        400 (`messages`: a body that may hold chat messages) more messages than the limit."""
        try:
            body = json.loads(await read_body(request, self.limits.max_body_bytes))
        except BodyTooLarge as e:
            raise HttpError(413, error_body(str(e), "invalid_request_error", code="request_too_large"),
                            {"connection": "close"}) from None
        except ValueError as e:
            raise HttpError(400, error_body(f"the request body is not valid JSON: {e}",
                                            "invalid_request_error")) from None
        listed = body.get("messages") if messages and isinstance(body, dict) else None
        if isinstance(listed, list) and len(listed) > self.limits.max_messages:
            raise HttpError(400, error_body(f"messages has {len(listed)} entries; this server accepts at most "
                                            f"{self.limits.max_messages} (AERIE_HTTP_MAX_MESSAGES)",
                                            "invalid_request_error", "messages"))
        return body

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, chat=True)

    # ---- generation ----------------------------------------------------------------------------

    async def _generate(self, request: Request, parse: Callable[[object], Parsed], chat: bool) -> Response:
        try:
            self._caller(request)
        except HttpError as e:
            return _error(e.status, e.body)
        try:
            body = await self.read_json(request, messages=chat)
        except HttpError as e:
            return e.response()
        try:
            metadata = self._caller(request)
            parsed = parse(body)
            info = await self._served(parsed.model)
            with_defaults(parsed, info.generation_defaults)
            check_limits(parsed, info)
        except BadParameter as e:
            return _error(400, error_body(str(e), "invalid_request_error", e.param))
        except HttpError as e:
            return _error(e.status, e.body)
        requests = parsed.choices()
        calls = [ResumingCall(self.stubs, r, metadata, self.resume_s) for r in requests]
        watcher = asyncio.create_task(_cancel_on_disconnect(request, calls))
        try:
            firsts = await asyncio.gather(*(c.read() for c in calls))  # every choice admitted, or none
        except grpc.aio.AioRpcError as e:
            watcher.cancel()
            _cancel(calls)
            status, body = name_param(*from_rpc(e), parsed.max_tokens_param)
            return JSONResponse(body, status_code=status, headers=retry_after(e))
        except asyncio.CancelledError:
            watcher.cancel()
            _cancel(calls)
            if watcher.done() and any(c.cancelled() for c in calls):
                return _closed()
            raise
        if any(first is grpc.aio.EOF for first in firsts):
            watcher.cancel()
            _cancel(calls)
            return _error(500, error_body("the coordinator ended the stream without a message", "internal_error"))
        try:
            echoed = None
            if parsed.echo:  # one text per prompt (choices are prompt-major: n in a row share it)
                texts = [await self._prompt_text(r, metadata) for r in requests[::parsed.n]]
                echoed = [text for text in texts for _ in range(parsed.n)]
        except grpc.aio.AioRpcError as e:
            watcher.cancel()
            _cancel(calls)
            return _error(*from_rpc(e))
        answer = _Answer(chat, info.model, firsts, parsed, echoed)
        if parsed.stream:
            return StreamingResponse(self._sse(calls, firsts, answer, parsed.include_usage, watcher),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def read_all(call, msg, reply: _Reply) -> None:
            while msg is not grpc.aio.EOF:
                reply.add(msg)
                msg = await call.read()

        try:
            await asyncio.gather(*(read_all(c, f, r) for c, f, r in zip(calls, firsts, answer.replies)))
        except grpc.aio.AioRpcError as e:
            _cancel(calls)
            return _error(*from_rpc(e))
        except asyncio.CancelledError:
            _cancel(calls)
            if any(c.cancelled() for c in calls):
                return _closed()  # the client went away
            raise
        finally:
            watcher.cancel()
        return JSONResponse(answer.whole())

    async def _prompt_text(self, req: cpb.GenerateRequest, metadata) -> str:
        """An echoed prompt's text: as the body gave it, or its token ids decoded by the coordinator
        (special tokens kept, as they were prompted)."""
        if req.HasField("prompt"):
            return req.prompt
        answer = await self.stub.Detokenize(cpb.DetokenizeRequest(tokens=req.prompt_ids, skip_special_tokens=False),
                                            timeout=INFO_TIMEOUT_S, metadata=metadata)
        return answer.text

    async def _sse(self, calls: list[ResumingCall], firsts: list[cpb.GenerateResponse], answer: _Answer,
                   include_usage: bool, watcher: asyncio.Task) -> AsyncIterator[str]:
        """The choices' messages as SSE chunks in the order they arrive (each names its choice's index)."""
        arrived: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            msg = firsts[i]
            try:
                while msg is not grpc.aio.EOF:
                    await arrived.put((i, msg))
                    msg = await calls[i].read()
                await arrived.put((i, None))
            except grpc.aio.AioRpcError as e:
                await arrived.put((i, e))
            except asyncio.CancelledError:  # its call was cancelled (the client left), or this task
                arrived.put_nowait((i, asyncio.CancelledError()))
                raise

        pumps = [asyncio.create_task(pump(i)) for i in range(len(calls))]
        try:
            for reply in answer.replies:
                if answer.chat:
                    first = reply.chunk({"role": "assistant", "content": ""}, None)
                    if reply.prompt_k is not None:  # vLLM's: with the first chunk
                        first["prompt_logprobs"] = reply.vllm_prompt_logprobs()
                    yield _event(first)
                elif reply.echo is not None or reply.prompt_k is not None:
                    yield _event(reply.echo_chunk())  # the prompt (and its log-probabilities) first
            running = len(calls)
            while running:
                i, msg = await arrived.get()
                if isinstance(msg, asyncio.CancelledError):
                    return  # the client went away
                if isinstance(msg, grpc.aio.AioRpcError):
                    if msg.code() == grpc.StatusCode.CANCELLED:
                        return  # the client went away: nobody reads further
                    yield _event(from_rpc(msg)[1])
                    break
                if msg is None:
                    running -= 1
                    continue
                reply = answer.replies[i]
                reply.add(msg)
                reason = FINISH.get(msg.finish_reason) if msg.finish_reason else None
                if not reply.generate:  # max_tokens=0: only the end
                    if reason:
                        yield _event(reply.chunk({}, reply.finish_reason))
                    continue
                lp = msg.logprobs if msg.HasField("logprobs") and msg.logprobs.token_ids else None
                if msg.text or reason or lp is not None:
                    yield _event(reply.chunk({"content": msg.text} if msg.text else {}, reason, lp))
            else:
                if include_usage:
                    yield _event(answer.usage_chunk())
        except asyncio.CancelledError:
            if any(c.cancelled() for c in calls):
                return
            raise
        finally:
            watcher.cancel()
            for task in pumps:
                task.cancel()
            _cancel(calls)
        yield "data: [DONE]\n\n"


def _cancel(calls: list[ResumingCall]) -> None:
    for call in calls:
        call.cancel()


async def _cancel_on_disconnect(request: Request, calls: list[ResumingCall]) -> None:
    """Cancel the Generate calls (and so their sequences) when the HTTP client disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("client disconnected: cancelling its sequence(s)")
            _cancel(calls)
            return


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Answer:
    """One request's answer in OpenAI's shapes (completion or chat): a _Reply per choice, one id (the
    first choice's sequence), usage summed over the choices (each prompt's tokens counted once)."""

    def __init__(self, chat: bool, model: str, firsts: list[cpb.GenerateResponse], parsed: Parsed,
                 echoed: list[str] | None = None) -> None:
        """`echoed`: each choice's prompt text (echo=true)."""
        self.chat = chat
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + firsts[0].sequence_id, "created": int(time.time()),
                "model": model}
        self.replies = [_Reply(chat, head, first, parsed, index, echoed[index] if echoed else None)
                        for index, first in enumerate(firsts)]
        self.n = parsed.n

    def usage(self) -> dict:
        prompt = sum(r.prompt_tokens for r in self.replies if r.index % self.n == 0)
        completion = sum(r.completion_tokens for r in self.replies)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_chunk(self) -> dict:
        return {**self.replies[0].head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage()}

    def whole(self) -> dict:
        out = {**self.replies[0].head("chat.completion" if self.chat else "text_completion"),
               "choices": [r.choice() for r in self.replies], "usage": self.usage()}
        if self.chat and self.replies[0].prompt_k is not None:  # vLLM's: of the answer (one prompt)
            out["prompt_logprobs"] = self.replies[0].vllm_prompt_logprobs()
        return out


class _Reply:
    """Accumulates one choice of a request's answer."""

    def __init__(self, chat: bool, head: dict, first: cpb.GenerateResponse, parsed: Parsed, index: int,
                 echo: str | None = None) -> None:
        """`echo`: the prompt's text, shown in front of the completion (echo=true)."""
        self.chat = chat
        self.index = index
        sampling = parsed.request.sampling
        self.want_logprobs = sampling.HasField("logprobs")
        self.top = sampling.logprobs  # the alternatives the legacy / chat views show
        self.echo = echo
        self.generate = parsed.generate  # False: max_tokens=0, the token generated is not shown
        self.prompt_k = parsed.prompt_logprobs  # vLLM's prompt_logprobs view (None: not asked)
        self.prompt_lp = first.prompt_logprobs if first.HasField("prompt_logprobs") else None
        self.logprobs: list[pb.TokenLogprobs] = []  # per message, when asked for
        self.offset = 0  # text_offset of the next streamed token (completions' logprobs)
        self._head = head  # id, created, model: the request's
        self.prompt_tokens = int(first.info.prompt_tokens)
        self.completion_tokens = 0
        self.text: list[str] = []
        self.finish_reason: str | None = None

    def add(self, msg: cpb.GenerateResponse) -> None:
        if msg.finish_reason:  # max_tokens=0: the budget of no tokens ended it
            self.finish_reason = FINISH.get(msg.finish_reason, msg.finish_reason) if self.generate else "length"
        if not self.generate:
            return
        self.completion_tokens += len(msg.tokens)
        self.text.append(msg.text)
        if msg.HasField("logprobs"):
            self.logprobs.append(msg.logprobs)

    def head(self, obj: str) -> dict:
        return {"id": self._head["id"], "object": obj, "created": self._head["created"], "model": self._head["model"]}

    def chunk(self, delta: dict, finish_reason: str | None, lp: pb.TokenLogprobs | None = None) -> dict:
        if self.chat:
            choice = {"index": self.index, "delta": delta,
                      "logprobs": chat_logprobs([lp]) if lp is not None else None, "finish_reason": finish_reason}
            return {**self.head("chat.completion.chunk"), "choices": [choice], "usage": None}
        logprobs = completion_logprobs([lp], self.offset, self.top) if lp is not None else None
        if logprobs is not None and logprobs["tokens"]:
            self.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {"index": self.index, "text": delta.get("content", ""), "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return {**self.head("text_completion"), "choices": [choice], "usage": None}

    def _prompt_lp(self) -> pb.TokenLogprobs:
        if self.prompt_lp is None:  # the coordinator always sends them when asked (a Resume never starts a stream)
            raise RuntimeError(f"choice {self.index}: the coordinator sent no prompt log-probabilities")
        return self.prompt_lp

    def vllm_prompt_logprobs(self) -> list:
        return vllm_prompt_logprobs(self._prompt_lp(), self.prompt_k or 0)

    def _echo_logprobs(self) -> dict | None:
        return echo_logprobs(self._prompt_lp(), self.echo or "", self.top) if self.want_logprobs else None

    def echo_chunk(self) -> dict:
        """The first streamed chunk of an echo / prompt_logprobs completion: the prompt's text and
        log-probabilities (the completion's text_offset continue after it)."""
        choice = {"index": self.index, "text": self.echo or "",
                  "logprobs": self._echo_logprobs() if self.echo is not None else None, "finish_reason": None}
        if self.prompt_k is not None:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs()
        self.offset = len(self.echo or "")
        return {**self.head("text_completion"), "choices": [choice], "usage": None}

    def choice(self) -> dict:
        text = "".join(self.text)
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(self.logprobs) if self.want_logprobs else None,
                    "finish_reason": self.finish_reason}
        logprobs = completion_logprobs(self.logprobs, len(self.echo or ""), self.top) if self.want_logprobs else None
        if self.echo is not None and logprobs is not None:  # the prompt's tokens first
            logprobs = {key: values + logprobs[key] for key, values in self._echo_logprobs().items()}
        out = {"index": self.index, "text": (self.echo or "") + text, "logprobs": logprobs,
               "finish_reason": self.finish_reason}
        if self.prompt_k is not None:
            out["prompt_logprobs"] = self.vllm_prompt_logprobs()
        return out
