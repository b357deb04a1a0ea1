"""OpenAI request bodies -> a Coordinator GenerateRequest, checked field by field.

Every field is either used, accepted for its neutral value, or refused: an unknown field, or a known
one aerie does not support (n > 1, presence/frequency penalties, tools, ...), is a `BadParameter`
naming the field and its value, which the app answers with HTTP 400 in OpenAI's error shape.
Nothing here talks to the coordinator.

    parsed = parse_completion(body)      # POST /v1/completions
    parsed = parse_chat(body)            # POST /v1/chat/completions
    parsed.request                       # cpb.GenerateRequest (text, stop strings, sampling)
    with_defaults(parsed, info.generation_defaults)   # the model's defaults for what the body left out

Refused with the reason: `echo: true` and vLLM's `prompt_logprobs` (the prompt's log-probabilities
are not computed: PROMPT_LOGPROBS_WHY). Used: the OpenAI sampling fields, `logprobs` / `top_logprobs`, and vLLM's extensions `top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`. Accepted and ignored
(neutral for one stateless completion): `user`, `metadata`, `store` (aerie stores nothing beyond the
sequence record every request has), `response_format: {"type": "text"}`, `tool_choice: "none"`,
`tools: []`, `parallel_tool_calls`, and an assistant message's `refusal: null` / `tool_calls: []`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from gateway.openai_schema import MAX_COMPLETION_LOGPROBS, ChatCompletionRequest, CompletionRequest, fields
from services.spec.sampling import MAX_LOGPROBS

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# echo / prompt_logprobs: the verifier's prefill applies the LM head to the prompt's last row only (its
# one token to sample); the prompt's log-probabilities would need every row's [P, V] logits, per chunk.
PROMPT_LOGPROBS_WHY = ("aerie does not compute the prompt's log-probabilities (its prefill keeps the logits "
                       "of the prompt's last row only)")
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1  # the widths of the proto fields they fill
_UNSET = object()


class BadParameter(ValueError):
    """An invalid or unsupported request field (HTTP 400, `param` names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Parsed:
    request: cpb.GenerateRequest
    model: str | None  # as asked (None = the served model)
    stream: bool
    include_usage: bool  # stream_options.include_usage
    unset: frozenset[str] = frozenset()  # sampling fields the body left out (the model's defaults fill them)
    max_tokens_param: str = "max_tokens"  # the body's name for the new-token limit (max_completion_tokens too)


# The sampling fields a model's generation_config.json may default, with OpenAI's own default.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


# The fields each route knows: its typed model's (gateway/openai_schema.py, also the OpenAPI
# document); the value checks are below.
_COMPLETION = fields(CompletionRequest)
_CHAT = fields(ChatCompletionRequest)
_MESSAGE = frozenset({"role", "content", "name"})  # and refusal / tool_calls when null or empty


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise BadParameter(name, f"{name} must be a number; got {_show(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise BadParameter(name, f"{name} must be in {bound}; got {_show(v)}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadParameter(name, f"{name} must be an integer; got {_show(v)}")
    if not lo <= v <= hi:
        raise BadParameter(name, f"{name} must be >= {lo} and <= {hi}; got {v}")
    return v


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise BadParameter(name, f"{name} must be true or false; got {_show(v)}")
    return v


def _refuse_unless(body: dict, name: str, allowed: tuple, why: str) -> None:
    v = body.get(name, None)
    if v is not None and not any(v is a or (v == a and type(v) is type(a)) for a in allowed):
        raise BadParameter(name, f"{name}={_show(v)} is not supported: {why}")


def _common(body: Any, fields: set[str]) -> tuple[cpb.GenerateRequest, str | None, bool, bool]:
    if not isinstance(body, dict):
        raise BadParameter("body", f"the request body must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadParameter(unknown[0], f"unrecognized request argument: {unknown[0]}={_show(body[unknown[0]])}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadParameter("model", f"model must be a string; got {_show(model)}")
    _refuse_unless(body, "n", (1,), "aerie returns one choice per request (n=1)")
    _refuse_unless(body, "best_of", (1,), "aerie returns one choice per request (best_of=1)")
    _refuse_unless(body, "prompt_logprobs", (), PROMPT_LOGPROBS_WHY)
    _refuse_unless(body, "presence_penalty", (0, 0.0), "aerie samples without penalties (use 0)")
    _refuse_unless(body, "frequency_penalty", (0, 0.0), "aerie samples without penalties (use 0)")
    if body.get("logit_bias"):
        raise BadParameter("logit_bias", f"logit_bias={_show(body['logit_bias'])} is not supported")
    _bool(body, "store")  # accepted either way: nothing is stored for later retrieval
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise BadParameter("metadata", f"metadata must be an object of strings; got {_show(metadata)}")
    stream = _bool(body, "stream") or False
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise BadParameter("stream_options", "stream_options is only allowed with stream=true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise BadParameter("stream_options", f"stream_options supports include_usage only; got {_show(opts)}")
        if opts.get("continuous_usage_stats"):
            raise BadParameter("stream_options.continuous_usage_stats",
                               "stream_options.continuous_usage_stats is not supported")
        include_usage = _bool(opts, "include_usage") or False
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1, 2**31 - 1)
    seed = _int(body, "seed", 0, INT64_MAX)
    min_p = _number(body, "min_p", 0.0, 1.0)
    repetition_penalty = _number(body, "repetition_penalty", 0.0, 100.0, lo_open=True)
    sampling = pb.SamplingParams(temperature=1.0 if temperature is None else temperature,
                                 top_k=0 if top_k in (None, -1) else top_k,
                                 seed=secrets.randbits(63) if seed is None else seed,
                                 min_p=min_p or 0.0, repetition_penalty=repetition_penalty or 1.0)
    if top_p is not None:
        sampling.top_p = top_p
    req = cpb.GenerateRequest(sampling=sampling)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
                                                for t in ids):
            raise BadParameter("stop_token_ids", f"stop_token_ids must be a list of token ids in [0, {INT64_MAX}]; "
                                                 f"got {_show(ids)}")
        req.stop_token_ids.extend(ids)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadParameter("stop", f"stop must be a string or a list of strings; got {_show(body['stop'])}")
        for i, s in enumerate(stop):
            if not s:
                raise BadParameter("stop", f"stop[{i}] is an empty string; a stop string needs at least one character")
        req.stop.extend(stop)
    if (v := _bool(body, "ignore_eos")) is not None:
        req.ignore_eos = v
    if (v := _bool(body, "skip_special_tokens")) is not None:
        req.skip_special_tokens = v
    return req, model, stream, include_usage


def _unset(body: dict) -> frozenset[str]:
    return frozenset(name for name in OPENAI_DEFAULTS if body.get(name) is None
                     and not (name == "top_k" and body.get("top_k") == -1))


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


def _max_tokens_param(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _logprobs(req: cpb.GenerateRequest, top: int | None) -> None:
    if top is not None:
        req.sampling.logprobs = top


def _max_tokens(body: dict, req: cpb.GenerateRequest, names: tuple[str, ...], default: int | None) -> None:
    given = {n: _int(body, n, 1, INT32_MAX) for n in names if body.get(n) is not None}
    if len(set(given.values())) > 1:
        raise BadParameter(names[-1], f"{' and '.join(f'{k}={v}' for k, v in given.items())} disagree: give one")
    value = next(iter(given.values()), default)
    if value is not None:
        req.max_new_tokens = value


def parse_completion(body: Any) -> Parsed:
    req, model, stream, include_usage = _common(body, _COMPLETION)
    _refuse_unless(body, "echo", (False,), "echo returns the prompt with its log-probabilities, and " + PROMPT_LOGPROBS_WHY)
    _refuse_unless(body, "suffix", ("",), "aerie does not support suffix (insertion)")
    prompt = body.get("prompt", _UNSET)
    if prompt is _UNSET or prompt is None:
        raise BadParameter("prompt", "prompt is required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadParameter("prompt", "prompt is an empty string: give at least one character")
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t > INT64_MAX for t in prompt):
            raise BadParameter("prompt", f"prompt token ids must be in [0, {INT64_MAX}]; got {_show(prompt)}")
        req.prompt_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadParameter("prompt", f"a batch of {len(prompt)} prompts is not supported: send one prompt per request")
    else:
        raise BadParameter("prompt", f"prompt must be a string or a list of token ids; got {_show(prompt)}")
    _max_tokens(body, req, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS)
    _logprobs(req, _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS))  # legacy: an int, the top-k count
    return Parsed(req, model, stream, include_usage, _unset(body), _max_tokens_param(body))


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadParameter(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}] must be a text part "
                                   f"({{'type': 'text', 'text': ...}}); got {_show(part)}")
            parts.append(part["text"])
        return "".join(parts)
    raise BadParameter(f"messages[{i}].content",
                       f"messages[{i}].content must be a string or a list of text parts; got {_show(content)}")


def parse_chat(body: Any) -> Parsed:
    req, model, stream, include_usage = _common(body, _CHAT)
    if body.get("tools"):
        raise BadParameter("tools", f"tools={_show(body['tools'])} is not supported: aerie generates plain text")
    _refuse_unless(body, "tool_choice", ("none",), "aerie generates plain text (tool_choice 'none' only)")
    _bool(body, "parallel_tool_calls")  # no tools, so nothing runs in parallel either way
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadParameter("response_format", f"response_format={_show(fmt)} is not supported: aerie generates "
                           f"plain text ({{'type': 'text'}})")
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise BadParameter("top_logprobs", f"top_logprobs={top} needs logprobs=true")
    _logprobs(req, (top or 0) if logprobs else None)
    _refuse_unless(body, "add_generation_prompt", (True,), "the chat template always ends with the assistant's turn")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadParameter("messages", f"messages must be a non-empty list; got {_show(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadParameter(f"messages[{i}]", f"messages[{i}] must be an object; got {_show(m)}")
        extra = sorted(set(m) - _MESSAGE - {k for k in ("refusal", "tool_calls") if not m.get(k)})
        if extra:
            raise BadParameter(f"messages[{i}].{extra[0]}", f"messages[{i}].{extra[0]}={_show(m[extra[0]])} "
                               f"is not supported")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadParameter(f"messages[{i}].role", f"messages[{i}].role must be a non-empty string; got {_show(role)}")
        req.messages.append(cpb.ChatMessage(role=role, content=_content(i, m.get("content", ""))))
    if (v := _bool(body, "skip_chat_template")) is not None:
        req.skip_chat_template = v
    _max_tokens(body, req, ("max_tokens", "max_completion_tokens"), None)
    return Parsed(req, model, stream, include_usage, _unset(body), _max_tokens_param(body))
