"""A request body validated by its typed model (gateway/openai_schema.py, the same models /openapi.json
serves), the first problem as a BadParameter in OpenAI's terms: `param` the field's path as the body
spells it (`messages[0].role`), the message its value and why.

    body = validated(openai_schema.DetokenizeRequest, json_body)   # a DetokenizeRequest, or BadParameter

    unknown field        unrecognized request argument: extra=1
    a refused value      add_generation_prompt=False is not supported: Input should be True
    a wrong value        tokens[0]: Input should be a valid integer; got 'x'
    a missing field      tokens is required

Used by /tokenize and /detokenize. /v1/completions and /v1/chat/completions still check values with the
hand-written parser (gateway/openai_request.py) whose messages carry aerie's reasons ("aerie returns
one choice per request"); tests/gateway/test_schema.py keeps the two in agreement (docs/clients.md).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.openai_request import BadParameter, _show

Body = TypeVar("Body", bound=BaseModel)
_MISSING = object()


def validated(model: type[Body], body: Any) -> Body:
    """`body` as `model`, or BadParameter naming the first invalid field."""
    if not isinstance(body, dict):
        raise BadParameter("body", f"the request body must be a JSON object; got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_parameter(e.errors()[0], body) from None


def bad_parameter(error: dict, body: dict) -> BadParameter:
    """One pydantic error -> BadParameter. Its `loc` also holds the names of union members tried
    (`str`, `list[TextPart]`): only the steps that exist in the body make the path."""
    path, value = "", body
    for step in error["loc"]:
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}" if path else step, value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif error["type"] in ("missing", "extra_forbidden") and isinstance(step, str):
            path, value = f"{path}.{step}" if path else step, _MISSING if error["type"] == "missing" else value
    path = path or "body"
    kind = error["type"]
    if kind == "extra_forbidden":
        return BadParameter(path, f"unrecognized request argument: {path}={_show(value)}")
    if kind == "missing" or value is _MISSING:
        return BadParameter(path, f"{path} is required")
    if kind == "literal_error":
        return BadParameter(path, f"{path}={_show(value)} is not supported: {error['msg']}")
    return BadParameter(path, f"{path}: {error['msg']}; got {_show(value)}")
