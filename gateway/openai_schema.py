"""Typed models (pydantic) of the HTTP API's request bodies, served as an OpenAPI document:

    GET /openapi.json      every route, and the body each POST route accepts (fields, types, ranges)

The models are the one list of the fields each route knows: gateway/openai_request.py derives its
accepted field sets from them, so a field cannot be accepted without being in the schema (and the
other way round). /tokenize and /detokenize are validated by their models (gateway/validation.py).
For the two generation routes the values a field may take are checked by the parser in openai_request.py (its
messages name the field and the value, its refusals name why: tests/gateway/test_openai_api.py);
tests/gateway/test_schema.py checks the two agree on bodies on both sides of each bound. What the
models do not express: which prompt / max-token fields may be combined, and that a value is refused
rather than merely invalid (n > 1, echo, a non-text response_format, ...): those are in the
descriptions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.spec.sampling import MAX_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions `logprobs`


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a 400 naming it; no coercion


NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]


class StreamOptions(_Body):
    include_usage: bool | None = Field(None, description="a last chunk with `choices: []` and `usage`")
    continuous_usage_stats: Literal[False] | None = Field(None, description="vLLM's; only false")


class _Sampling(_Body):
    """Fields of both generation routes."""
    model: str | None = Field(None, description="the served model (/v1/models); omitted = it")
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1,
                                   description="at most the server's cap (/v1/models max_tokens)")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; default: the model's "
                                      "generation_config.json, else 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="vLLM's; -1 or 0 = off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's; 0 = off")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="vLLM's; 1 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="unset = a random seed")
    stop: NonEmpty | list[NonEmpty] | None = Field(None, description="stop strings")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM's; token ids that end the sequence")
    n: Literal[1] | None = None
    best_of: Literal[1] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    user: str | None = Field(None, description="accepted, ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted, ignored")
    store: bool | None = Field(None, description="accepted, ignored: nothing is stored for retrieval")
    ignore_eos: bool | None = Field(None, description="vLLM's")
    skip_special_tokens: bool | None = Field(None, description="vLLM's; default true")
    presence_penalty: float | None = Field(None, ge=0, le=0, description="only 0 (not supported)")
    frequency_penalty: float | None = Field(None, ge=0, le=0, description="only 0 (not supported)")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="only empty (not supported)")
    prompt_logprobs: None = Field(None, description="vLLM's; only null: the prompt's log-probabilities are not "
                                                    "computed (the prefill keeps the last prompt row's logits)")


class CompletionRequest(_Sampling):
    """POST /v1/completions."""
    prompt: NonEmpty | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[NonEmpty | Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)] = Field(
        description="text or token ids; a list of one prompt is that prompt (a batch of several is refused)")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="the target's log-probabilities, with this many alternatives")
    echo: Literal[False] | None = Field(None, description="only false: the prompt's log-probabilities are not "
                                                          "computed (the prefill keeps the last prompt row's logits)")
    suffix: Literal[""] | None = Field(None, description="only empty (not supported)")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: NonEmpty
    content: str | list[TextPart] = ""
    name: str | None = None
    refusal: None = Field(None, description="accepted when null")
    tool_calls: list[Any] | None = Field(None, max_length=0, description="accepted when empty")


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1, description="the model's chat template is applied")
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="max_tokens' newer name")
    logprobs: bool | None = Field(None, description="the target's log-probabilities of the answer's tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs=true")
    tools: list[Any] | None = Field(None, max_length=0, description="only empty (tools are not supported)")
    tool_choice: Literal["none"] | None = None
    response_format: ResponseFormat | None = Field(None, description='only {"type": "text"}')
    parallel_tool_calls: bool | None = Field(None, description="accepted, ignored")
    add_generation_prompt: Literal[True] | None = None
    skip_chat_template: bool | None = Field(None, description="aerie's: concatenate the contents instead")


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): exactly one of prompt and messages."""
    model: str | None = None
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="prompt only")
    add_generation_prompt: Literal[True] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's)."""
    model: str | None = None
    tokens: list[TokenId]


BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
GETS = {"/v1/models": "the served model", "/health": "readiness", "/metrics": "Prometheus text",
        "/version": "aerie's version"}


def fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields)


def openapi(version: str) -> dict:
    """The OpenAPI 3.1 document of the HTTP API (request bodies; answers are OpenAI's shapes)."""
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        paths[path] = {"post": {
            "summary": (model.__doc__ or "").strip(),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OpenAI's (or vLLM's) answer"},
                          "400": {"description": "a field's name and value (OpenAI's error shape)"}}}}
    for path, what in GETS.items():
        paths[path] = {"get": {"summary": what, "responses": {"200": {"description": what}}}}
    return {"openapi": "3.1.0", "info": {"title": "aerie OpenAI-compatible API", "version": version},
            "paths": paths, "components": {"schemas": schemas}}
