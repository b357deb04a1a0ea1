"""OpenAI request bodies -> a Coordinator GenerateRequest.

The body is validated by its typed model (gateway/openai_schema.py, also /openapi.json) through
gateway/validation.py: an unknown field, a value out of its range, or a known field aerie does not
support (best_of > 1, presence/frequency penalties, tools, echo, ...) is a `BadParameter` naming the field
and its value, which the app answers with HTTP 400 in OpenAI's error shape. This module only maps a
valid body onto the proto and fills the model's defaults. Nothing here talks to the coordinator.

    parsed = parse_completion(body)      # POST /v1/completions
    parsed = parse_chat(body)            # POST /v1/chat/completions
    parsed.request                       # cpb.GenerateRequest (text, stop strings, sampling)
    with_defaults(parsed, info.generation_defaults)   # the model's defaults for what the body left out

Used: the OpenAI sampling fields, `logprobs` / `top_logprobs`, and vLLM's extensions `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`. Accepted and ignored
(neutral for one stateless completion): `user`, `metadata`, `store` (aerie stores nothing beyond the
sequence record every request has), `response_format: {"type": "text"}`, `tool_choice: "none"`,
`tools: []`, `parallel_tool_calls`, and an assistant message's `refusal: null` / `tool_calls: []`.
Refused with the reason (the models' `refusals`): best_of > 1, penalties, a logit bias, tools. Several
choices (n, a batch of prompts on /v1/completions) are one GenerateRequest each (`Parsed.choices`).

The prompt's log-probabilities: `echo: true` with `logprobs: k` on /v1/completions and vLLM's
`prompt_logprobs: k` (both routes) set sampling.prompt_logprobs to the larger k (each view shows its
own k). `max_tokens: 0` with echo (OpenAI's legacy scoring) asks the coordinator for one token, which
the answer drops (`Parsed.generate` False): the prefill samples that token anyway, so it costs nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, GenerationRequest
from gateway.validation import BadParameter, validated

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class Parsed:
    request: cpb.GenerateRequest  # the first prompt's; `choices()` gives every choice's
    model: str | None  # as asked (None = the served model)
    stream: bool
    include_usage: bool  # stream_options.include_usage
    unset: frozenset[str] = frozenset()  # sampling fields the body left out (the model's defaults fill them)
    max_tokens_param: str = "max_tokens"  # the body's name for the new-token limit (max_completion_tokens too)
    n: int = 1  # choices per prompt
    more_prompts: tuple[str | tuple[int, ...], ...] = ()  # a batch's prompts after the first (completions)
    echo: bool = False  # completions: the prompt (and with logprobs its log-probabilities) in front of the answer
    generate: bool = True  # False: max_tokens=0 with echo, the one token generated is dropped
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the alternatives its view shows

    def choices(self) -> list[cpb.GenerateRequest]:
        """One GenerateRequest per choice, prompt-major (choice i*n + k is prompt i's k-th): the
        request with each prompt, and choice k's seed the request's + k (mod 2**63), so a prompt's
        choices do not depend on what else the batch holds. Call after `with_defaults`."""
        out = []
        for prompt in (None, *self.more_prompts):
            for k in range(self.n):
                req = cpb.GenerateRequest()
                req.CopyFrom(self.request)
                if prompt is not None:
                    req.ClearField("prompt")
                    req.ClearField("prompt_ids")
                if isinstance(prompt, str):
                    req.prompt = prompt
                elif prompt is not None:
                    req.prompt_ids.extend(prompt)
                req.sampling.seed = (self.request.sampling.seed + k) % 2**63
                out.append(req)
        return out


# The sampling fields a model's generation_config.json may default, with OpenAI's own default.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _request(body: GenerationRequest) -> cpb.GenerateRequest:
    """The fields both routes share, on the proto (OpenAI's defaults for what the body left out)."""
    sampling = pb.SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                 top_k=0 if body.top_k in (None, -1) else body.top_k,
                                 seed=secrets.randbits(63) if body.seed is None else body.seed,
                                 min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 1.0)
    if body.top_p is not None:
        sampling.top_p = body.top_p
    req = cpb.GenerateRequest(sampling=sampling)
    req.stop_token_ids.extend(body.stop_token_ids or ())
    req.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or ())
    if body.ignore_eos is not None:
        req.ignore_eos = body.ignore_eos
    if body.skip_special_tokens is not None:
        req.skip_special_tokens = body.skip_special_tokens
    return req


def _parsed(body: GenerationRequest, req: cpb.GenerateRequest, max_tokens_param: str,
            more_prompts: tuple[str | tuple[int, ...], ...] = (), echo: bool = False, generate: bool = True) -> Parsed:
    unset = frozenset(name for name in OPENAI_DEFAULTS if getattr(body, name) is None)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    wanted = [k for k in (body.prompt_logprobs, req.sampling.logprobs if echo and
                          req.sampling.HasField("logprobs") else None) if k is not None]
    if wanted:
        req.sampling.prompt_logprobs = max(wanted)
    return Parsed(req, body.model, bool(body.stream), include_usage, unset, max_tokens_param, body.n or 1,
                  more_prompts, echo, generate, body.prompt_logprobs)


def with_defaults(parsed: Parsed, defaults: cpb.GenerationDefaults) -> None:
    """Fill the sampling fields the body left out from the model's generation_config.json (vLLM's
    behaviour); the rest keep OpenAI's defaults, set by the parser."""
    sampling = parsed.request.sampling
    for name in parsed.unset:
        if defaults.HasField(name):
            setattr(sampling, name, getattr(defaults, name))


def check_limits(parsed: Parsed, info: cpb.CoordinatorInfo) -> None:
    """The new-token limit against the server's cap (AERIE_MAX_NEW_TOKENS, /v1/models' max_tokens),
    named as the body named it (the coordinator would say max_new_tokens)."""
    req, name = parsed.request, parsed.max_tokens_param
    if req.HasField("max_new_tokens") and info.max_new_tokens and req.max_new_tokens > info.max_new_tokens:
        raise BadParameter(name, f"{name} must be <= {info.max_new_tokens} (this server's limit on new tokens); "
                           f"got {req.max_new_tokens}")


def parse_completion(json_body: Any) -> Parsed:
    body = validated(CompletionRequest, json_body)
    req = _request(body)
    first, *more = body.prompts()
    if isinstance(first, str):
        req.prompt = first
    else:
        req.prompt_ids.extend(first)
    req.max_new_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
    if body.logprobs is not None:  # legacy: an int, the top-k count
        req.sampling.logprobs = body.logprobs
    return _parsed(body, req, "max_tokens", tuple(p if isinstance(p, str) else tuple(p) for p in more),
                   bool(body.echo), body.max_tokens != 0)


def parse_chat(json_body: Any) -> Parsed:
    body = validated(ChatCompletionRequest, json_body)
    req = _request(body)
    if body.logprobs:
        req.sampling.logprobs = body.top_logprobs or 0
    req.messages.extend(cpb.ChatMessage(role=m.role, content=m.text()) for m in body.messages)
    if body.skip_chat_template is not None:
        req.skip_chat_template = body.skip_chat_template
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None:
        req.max_new_tokens = max_tokens
    return _parsed(body, req, "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
