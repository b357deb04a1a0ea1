"""Typed models (pydantic) of the HTTP API's request bodies, served as an OpenAPI document:

    GET /openapi.json      every route, and the body each POST route accepts (fields, types, ranges)

The models are the one source of the fields each route knows, their types and ranges: every route
with a body is validated by its model (gateway/validation.py turns the first error into a 400 naming
the field), so what /openapi.json says is what the server checks. What a type cannot say is in the
models' validators, which raise a Problem in aerie's words: a batch of prompts, an empty stop string,
rules across fields (top_logprobs needs logprobs, stream_options needs stream, max_tokens and
max_completion_tokens agree, max_tokens=0 needs echo). A field aerie accepts only in its neutral value (n=1, ...)
is in `refusals` with the reason its 400 gives. Several choices (a batch of prompts, n) are several
sequences; gateway/app.py runs them at once. gateway/openai_request.py turns a validated body into
the Coordinator's GenerateRequest.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.validation import Problem, show
from services.spec.sampling import MAX_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions `logprobs`
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1  # the widths of the proto fields they fill
MAX_CHOICES = 64  # choices one request may ask for, prompts x n: each is a sequence of its own
NO_RANKING = "aerie does not sample extra candidates to rank: ask for n choices instead"
NO_PENALTIES = "aerie samples without penalties (use 0)"
PLAIN_TEXT = "aerie generates plain text"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field is a 400 naming it; no coercion


NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _batch(prompt: Any) -> list:
    """The prompts of a `prompt` field: "a" -> ["a"], [5, 6] -> [[5, 6]], ["a", [5]] -> as it is."""
    several = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    return list(prompt) if several else [prompt]


class StreamOptions(_Body):
    include_usage: bool | None = Field(None, description="a last chunk with `choices: []` and `usage`")
    continuous_usage_stats: Literal[False] | None = Field(None, description="vLLM's; only false")


class GenerationRequest(_Body):
    """Fields of both generation routes."""
    refusals: ClassVar[dict[str, str]] = {  # field -> why only its neutral value is accepted
        "best_of": f"{NO_RANKING} (best_of=1)",
        "presence_penalty": NO_PENALTIES, "frequency_penalty": NO_PENALTIES,
        "logit_bias": "aerie samples without a logit bias (use {})"}
    model: str | None = Field(None, description="the served model (/v1/models); omitted = it")
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="at most the server's cap (/v1/models max_tokens)")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; default: the model's "
                                      "generation_config.json, else 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="vLLM's; -1 or 0 = off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's; 0 = off")
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="vLLM's; 1 = off")
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description="unset = a random seed")
    stop: NonEmpty | list[NonEmpty] | None = Field(None, description="stop strings")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM's; token ids that end the sequence")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices per prompt, each a sequence of its "
                          f"own (at most {MAX_CHOICES} choices a request, prompts x n); with a seed, choice k "
                          "samples with seed + k")
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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "vLLM's: the target's log-probability of each prompt token (null for the first) with this many "
        "alternatives, as `prompt_logprobs` (per choice on /v1/completions, of the answer on chat)"))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) and v:
            return v
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Problem("stop", f"stop must be a string or a list of strings; got {show(v)}")
        for i, s in enumerate(stops):
            if not s:
                raise Problem("stop", f"stop[{i}] is an empty string; a stop string needs at least one character")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, v: Any) -> Any:
        if v is not None and not (_token_ids(v) and all(0 <= t <= INT64_MAX for t in v)):
            raise Problem("stop_token_ids", f"stop_token_ids must be a list of token ids in [0, {INT64_MAX}]; "
                                            f"got {show(v)}")
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values()))):
            raise Problem("metadata", f"metadata must be an object of strings; got {show(v)}")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise Problem("stream_options", "stream_options is only allowed with stream=true")
        return self


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""
    refusals: ClassVar[dict[str, str]] = {
        **GenerationRequest.refusals, "suffix": "aerie does not support suffix (insertion)"}
    prompt: NonEmpty | Annotated[list[TokenId], Field(min_length=1)] | Annotated[
        list[NonEmpty | Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)
    ] = Field(description="text or token ids, or a batch of them (a choice per prompt and n, the prompt's choices "
                          "at indices [i*n, (i+1)*n))")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="the target's log-probabilities, with this many alternatives")
    echo: bool | None = Field(None, description="the prompt's text in front of the completion's; with logprobs, "
                                                "the prompt's tokens first (the first one's logprob null)")
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description=(
        "at most the server's cap (/v1/models max_tokens); 0 only with echo (score the prompt, generate nothing)"))
    suffix: Literal[""] | None = Field(None, description="only empty (not supported)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        """aerie's words for the prompt's shapes: one text or one list of token ids, or a batch of them."""
        if v is None:
            raise Problem("prompt", "prompt is required")
        batch = _batch(v)
        if len(batch) > MAX_CHOICES:
            raise Problem("prompt", f"a batch of {len(batch)} prompts is more than the {MAX_CHOICES} choices a "
                                    "request may ask for")
        for i, one in enumerate(batch):
            name = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            if isinstance(one, str) and not one:
                raise Problem("prompt", f"{name} is an empty string: give at least one character")
            if one and _token_ids(one) and not all(0 <= t <= INT64_MAX for t in one):
                raise Problem("prompt", f"{name} token ids must be in [0, {INT64_MAX}]; got {show(one)}")
            if not isinstance(one, str) and not (one and _token_ids(one)):
                raise Problem("prompt", f"{name} must be a string or a list of token ids; got {show(one)}")
        return v

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise Problem("max_tokens", "max_tokens=0 needs echo=true (it scores the prompt and generates nothing); "
                                        "otherwise max_tokens must be >= 1")
        prompts, n = len(self.prompts()), self.n or 1
        if prompts * n > MAX_CHOICES:
            raise Problem("n", f"{prompts} prompts x n={n} is {prompts * n} choices; a request may ask for at most "
                               f"{MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts: text or token ids each (a single prompt is a batch of one)."""
        return _batch(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: NonEmpty
    content: str | list[TextPart] = ""
    name: str | None = None
    refusal: None = Field(None, description="accepted when null")
    tool_calls: list[Any] | None = Field(None, max_length=0, description="accepted when empty")

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise Problem("content", f"content must be a string or a list of text parts; got {show(v)}")
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Problem(f"content[{j}]", f"content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                                               f"got {show(part)}")
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""
    refusals: ClassVar[dict[str, str]] = {
        **GenerationRequest.refusals, "tools": PLAIN_TEXT, "tool_choice": f"{PLAIN_TEXT} (tool_choice 'none' only)",
        "response_format": f"{PLAIN_TEXT} ({{'type': 'text'}})",
        "add_generation_prompt": "the chat template always ends with the assistant's turn"}
    messages: list[ChatMessage] = Field(min_length=1, description="the model's chat template is applied")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="max_tokens' newer name")
    logprobs: bool | None = Field(None, description="the target's log-probabilities of the answer's tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs=true")
    tools: list[Any] | None = Field(None, max_length=0, description="only empty (tools are not supported)")
    tool_choice: Literal["none"] | None = None
    response_format: ResponseFormat | None = Field(None, description='only {"type": "text"}')
    parallel_tool_calls: bool | None = Field(None, description="accepted, ignored")
    add_generation_prompt: Literal[True] | None = None
    skip_chat_template: bool | None = Field(None, description="aerie's: concatenate the contents instead")

    @model_validator(mode="after")
    def _across_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise Problem("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true")
        given = {k: v for k, v in (("max_tokens", self.max_tokens), ("max_completion_tokens",
                                                                        self.max_completion_tokens)) if v is not None}
        if len(set(given.values())) > 1:
            raise Problem("max_completion_tokens", " and ".join(f"{k}={v}" for k, v in given.items())
                          + " disagree: give one")
        return self


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
