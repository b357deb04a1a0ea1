"""The typed models (gateway/openai_schema.py, served as /openapi.json) are the request validation of
every route with a body (gateway/validation.py): bodies on both sides of every bound are accepted or
refused, the refusal naming the field, its value and the reason. Pure: no servers."""

import pytest
from pydantic import ValidationError

from gateway import openai_schema as schema
from gateway.extras import detokenize_request, tokenize_request
from gateway.openai_request import parse_chat, parse_completion
from gateway.validation import BadParameter

COMPLETION = {"prompt": "t5 t6"}
CHAT = {"messages": [{"role": "user", "content": "t5"}]}
USER = {"role": "user", "content": "t5"}

CASES = [  # (route, body changes, accepted?)
    ("completions", {}, True),
    ("completions", {"prompt": [5, 6]}, True),
    ("completions", {"prompt": [[5, 6]]}, True),
    ("completions", {"prompt": ["a"]}, True),
    ("completions", {"prompt": ["a", "b"]}, True),
    ("completions", {"prompt": ["a", [5, 6]]}, True),
    ("completions", {"prompt": ["a", []]}, False),
    ("completions", {"prompt": ""}, False),
    ("completions", {"prompt": [-1]}, False),
    ("completions", {"prompt": 7}, False),
    ("completions", {"temperature": 2}, True), ("completions", {"temperature": 2.01}, False),
    ("completions", {"temperature": 0}, True), ("completions", {"temperature": -0.1}, False),
    ("completions", {"temperature": "1"}, False),
    ("completions", {"top_p": 1}, True), ("completions", {"top_p": 0}, False),
    ("completions", {"top_k": -1}, True), ("completions", {"top_k": -2}, False), ("completions", {"top_k": 2.0}, False),
    ("completions", {"min_p": 1}, True), ("completions", {"min_p": 1.5}, False),
    ("completions", {"repetition_penalty": 0.5}, True), ("completions", {"repetition_penalty": 0}, False),
    ("completions", {"seed": 2**63 - 1}, True), ("completions", {"seed": 2**63}, False),
    ("completions", {"seed": -1}, False),
    ("completions", {"max_tokens": 1}, True), ("completions", {"max_tokens": 0}, False),
    ("completions", {"max_tokens": 2**31 - 1}, True), ("completions", {"max_tokens": 2**31}, False),
    ("completions", {"prompt": [2**63 - 1]}, True), ("completions", {"prompt": [2**63]}, False),
    ("completions", {"stop_token_ids": [2**63 - 1]}, True), ("completions", {"stop_token_ids": [2**63]}, False),
    ("completions", {"logprobs": 5}, True), ("completions", {"logprobs": 6}, False),
    ("completions", {"stop": "x"}, True), ("completions", {"stop": ["x", "y"]}, True),
    ("completions", {"stop": [""]}, False), ("completions", {"stop": 7}, False),
    ("completions", {"stop_token_ids": [0, 5]}, True), ("completions", {"stop_token_ids": [-1]}, False),
    ("completions", {"stop_token_ids": [True]}, False),
    ("completions", {"n": 1}, True), ("completions", {"n": 64}, True), ("completions", {"n": 65}, False),
    ("completions", {"n": 0}, False), ("completions", {"best_of": 3}, False),
    ("completions", {"prompt": ["a"] * 64}, True), ("completions", {"prompt": ["a"] * 65}, False),
    ("completions", {"prompt": ["a", "b"], "n": 32}, True), ("completions", {"prompt": ["a", "b"], "n": 33}, False),
    ("completions", {"presence_penalty": 0.0}, True), ("completions", {"presence_penalty": 0.5}, False),
    ("completions", {"logit_bias": {}}, True), ("completions", {"logit_bias": {"5": 1.0}}, False),
    ("completions", {"echo": False}, True), ("completions", {"echo": True}, True),
    ("completions", {"echo": True, "max_tokens": 0}, True), ("completions", {"max_tokens": 0}, False),
    ("chat", {"max_tokens": 0}, False),
    ("completions", {"prompt_logprobs": None}, True), ("completions", {"prompt_logprobs": 1}, True),
    ("completions", {"prompt_logprobs": 0}, True), ("chat", {"prompt_logprobs": 20}, True),
    ("chat", {"prompt_logprobs": 21}, False), ("completions", {"prompt_logprobs": -1}, False),
    ("completions", {"suffix": "x"}, False),
    ("completions", {"stream": True, "stream_options": {"include_usage": True}}, True),
    ("completions", {"stream": 1}, False),
    ("completions", {"metadata": {"a": "b"}, "store": True, "user": "u"}, True),
    ("completions", {"metadata": {"a": 1}}, False),
    ("completions", {"ignore_eos": True, "skip_special_tokens": False}, True),
    ("completions", {"frobnicate": 1}, False),
    ("completions", {"top_logprobs": 2}, False),  # a chat field
    ("chat", {}, True),
    ("chat", {"messages": []}, False),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "t5"}]}]}, True),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    ("chat", {"messages": [{"role": "", "content": "t5"}]}, False),
    ("chat", {"messages": [USER, {"role": "assistant", "content": "t6", "refusal": None, "tool_calls": []}]}, True),
    ("chat", {"messages": [USER, {"role": "assistant", "content": "t6", "refusal": "no"}]}, False),
    ("chat", {"messages": [{"role": "user", "content": "t5", "audio": {}}]}, False),
    ("chat", {"logprobs": True, "top_logprobs": 20}, True), ("chat", {"logprobs": True, "top_logprobs": 21}, False),
    ("chat", {"max_completion_tokens": 4}, True), ("chat", {"max_completion_tokens": 0}, False),
    ("chat", {"max_completion_tokens": 2**31 - 1}, True), ("chat", {"max_completion_tokens": 2**31}, False),
    ("chat", {"tools": []}, True), ("chat", {"tools": [{"type": "function"}]}, False),
    ("chat", {"tool_choice": "none"}, True), ("chat", {"tool_choice": "auto"}, False),
    ("chat", {"response_format": {"type": "text"}}, True),
    ("chat", {"response_format": {"type": "json_object"}}, False),
    ("chat", {"parallel_tool_calls": False, "skip_chat_template": True}, True),
    ("chat", {"add_generation_prompt": True}, True), ("chat", {"add_generation_prompt": False}, False),
    ("chat", {"echo": False}, False),  # a completions field
]


def _root(param: str) -> str:
    return param.split(".")[0].split("[")[0]


@pytest.mark.parametrize("route,body,accepted", CASES, ids=[f"{r}-{sorted(b)}-{a}" for r, b, a in CASES])
def test_bounds_are_the_models(route, body, accepted):
    """The routes' parsers accept exactly what the typed models (the OpenAPI document) accept."""
    model = schema.CompletionRequest if route == "completions" else schema.ChatCompletionRequest
    full = {**(COMPLETION if route == "completions" else CHAT), **body}
    parser = parse_completion if route == "completions" else parse_chat
    if accepted:
        parser(full)
        model.model_validate(full)
        return
    with pytest.raises(BadParameter) as refused:
        parser(full)
    with pytest.raises(ValidationError):
        model.model_validate(full)
    assert _root(refused.value.param) in body, (refused.value.param, str(refused.value))


GENERATION_400 = [  # (route, body changes, param, the message, whole or its start)
    ("completions", {"stop": [""]}, "stop", "stop[0] is an empty string; a stop string needs at least one character"),
    ("completions", {"stop": ["x", 7]}, "stop", "stop must be a string or a list of strings; got ['x', 7]"),
    ("completions", {"prompt": ["a", 7]}, "prompt", "prompt must be a string or a list of token ids; got ['a', 7]"),
    ("completions", {"prompt": None}, "prompt", "prompt is required"),
    ("completions", {"prompt": [5, 2**64]}, "prompt", "prompt token ids must be in [0, 9223372036854775807]; got "),
    ("completions", {"prompt": [5, True]}, "prompt", "prompt must be a string or a list of token ids; got [5, True]"),
    ("completions", {"max_tokens": 10**12}, "max_tokens", "max_tokens must be >= 0 and <= 2147483647; got 1000000000000"),
    ("completions", {"top_p": 0}, "top_p", "top_p must be > 0 and <= 1; got 0"),
    ("completions", {"seed": 2**63}, "seed", "seed must be >= 0 and <= 9223372036854775807; got "),
    ("completions", {"top_k": 2.0}, "top_k", "top_k: Input should be a valid integer; got 2.0"),
    ("completions", {"stop_token_ids": ["x"]}, "stop_token_ids",
     "stop_token_ids must be a list of token ids in [0, 9223372036854775807]; got ['x']"),
    ("completions", {"metadata": {"a": 1}}, "metadata", "metadata must be an object of strings; got {'a': 1}"),
    ("completions", {"n": 65}, "n", "n must be >= 1 and <= 64; got 65"),
    ("completions", {"best_of": 2}, "best_of", "best_of=2 is not supported: aerie does not sample extra candidates"),
    ("completions", {"prompt": ["a", [5, -1]]}, "prompt", "prompt[1] token ids must be in [0, 9223372036854775807]"),
    ("completions", {"prompt": ["a"] * 65}, "prompt", "a batch of 65 prompts is more than the 64 choices"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5 is not supported: aerie "
     "samples without penalties"),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 needs echo=true (it scores the prompt"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be >= 0 and <= 20; got 21"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed with stream=true"),
    ("completions", {"frobnicate": 1}, "frobnicate", "unrecognized request argument: frobnicate=1"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "top_logprobs=2 needs logprobs=true"),
    ("chat", {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens",
     "max_tokens=3 and max_completion_tokens=4 disagree: give one"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format",
     "response_format={'type': 'json_object'} is not supported: aerie generates plain text"),
    ("chat", {"messages": [USER, {"role": "user", "content": [{"type": "image_url"}]}]}, "messages[1].content[0]",
     "messages[1].content[0] must be a text part ({'type': 'text', 'text': ...}); got {'type': 'image_url'}"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content must be a string or a list of text parts; got 5"),
    ("chat", {"messages": [{"role": "user", "content": "t5", "audio": {}}]}, "messages[0].audio",
     "unrecognized request argument: messages[0].audio={}"),
]


@pytest.mark.parametrize("route,body,param,message", GENERATION_400, ids=[c[2] for c in GENERATION_400])
def test_generation_routes_are_validated_by_their_models(route, body, param, message):
    """/v1/completions and /v1/chat/completions: the 400 names the field as the body spells it, its
    value and the reason (a range from the model's bounds, a refusal's reason, a validator's words)."""
    parser = parse_completion if route == "completions" else parse_chat
    with pytest.raises(BadParameter) as e:
        parser({**(COMPLETION if route == "completions" else CHAT), **body})
    assert e.value.param == param and str(e.value).startswith(message), (e.value.param, str(e.value))


def test_a_valid_body_maps_onto_the_generate_request():
    p = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 7, "stop": "x", "stop_token_ids": [2], "top_k": -1, "seed": 3,
                    "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}})
    req = p.request
    assert (req.messages[0].content, req.max_new_tokens, list(req.stop), list(req.stop_token_ids)) == ("ab", 7, ["x"], [2])
    assert (req.sampling.top_k, req.sampling.seed, req.sampling.logprobs) == (0, 3, 2)
    assert (p.stream, p.include_usage, p.max_tokens_param) == (True, True, "max_completion_tokens")
    assert p.unset == {"temperature", "top_p", "min_p", "repetition_penalty"}
    c = parse_completion({"prompt": [[5, 6]], "temperature": 0})
    assert (list(c.request.prompt_ids), c.request.max_new_tokens, c.request.sampling.temperature) == ([5, 6], 16, 0)
    assert not c.request.sampling.HasField("logprobs") and c.max_tokens_param == "max_tokens"


def test_vllm_routes_agree():
    for body, ok in [({"prompt": "x"}, True), ({"messages": [USER]}, True), ({"prompt": ""}, False),
                     ({"prompt": "x", "bogus": 1}, False)]:
        if ok:
            tokenize_request(body)
            schema.TokenizeRequest.model_validate(body)
        else:
            with pytest.raises(BadParameter):
                tokenize_request(body)
            with pytest.raises(ValidationError):
                schema.TokenizeRequest.model_validate(body)
    detokenize_request({"tokens": [1, 2]})
    schema.DetokenizeRequest.model_validate({"tokens": [1, 2]})
    with pytest.raises(BadParameter):
        detokenize_request({"tokens": "x"})
    with pytest.raises(ValidationError):
        schema.DetokenizeRequest.model_validate({"tokens": "x"})


@pytest.mark.parametrize("route,body,param,message", [
    ("detokenize", {"tokens": [5], "extra": 1}, "extra", "unrecognized request argument: extra=1"),
    ("detokenize", {}, "tokens", "tokens is required"),
    ("detokenize", {"tokens": [5, "x"]}, "tokens[1]", "tokens[1]: Input should be a valid integer; got 'x'"),
    ("detokenize", {"tokens": [True]}, "tokens[0]", "got True"),
    ("detokenize", {"tokens": [-1]}, "tokens[0]", "greater than or equal to 0; got -1"),
    ("detokenize", {"tokens": [2**63]}, "tokens[0]", "got 9223372036854775808"),
    ("detokenize", [5], "body", "must be a JSON object; got list"),
    ("tokenize", {"prompt": ""}, "prompt", "prompt: String should have at least 1 character; got ''"),
    ("tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]",
     "messages[0].content[0] must be a text part ({'type': 'text', 'text': ...}); got {'type': 'image_url'}"),
    ("tokenize", {"messages": [{"content": "t5"}]}, "messages[0].role", "messages[0].role is required"),
    ("tokenize", {"messages": [USER], "add_generation_prompt": False}, "add_generation_prompt",
     "add_generation_prompt=False is not supported: Input should be True"),
    ("tokenize", {"prompt": "x", "messages": [USER]}, "prompt", "give exactly one of prompt and messages"),
    ("tokenize", {}, "prompt", "give exactly one of prompt and messages"),
])
def test_vllm_routes_are_validated_by_their_models(route, body, param, message):
    """/tokenize and /detokenize: the typed model is the validation (gateway/validation.py); the 400
    names the field as the body spells it, its value and the model's reason."""
    parse = tokenize_request if route == "tokenize" else detokenize_request
    with pytest.raises(BadParameter) as e:
        parse(body)
    assert e.value.param == param and message in str(e.value), (e.value.param, str(e.value))
    msg, strs = tokenize_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
                                  "return_token_strs": True})
    assert (msg.messages[0].content, strs) == ("ab", True)
    assert list(detokenize_request({"tokens": [0, 2**63 - 1]}).tokens) == [0, 2**63 - 1]


def test_openapi_document_lists_every_route_and_field():
    doc = schema.openapi("0.1.0")
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"] == "0.1.0"
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/health",
            "/metrics", "/version"} <= set(doc["paths"])
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert set(chat["properties"]) == schema.fields(schema.ChatCompletionRequest)
    assert chat["additionalProperties"] is False and chat["required"] == ["messages"]
    top = chat["properties"]["top_logprobs"]["anyOf"][0]
    assert (top["minimum"], top["maximum"]) == (0, 20)
