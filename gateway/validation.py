"""A request body validated by its typed model (gateway/openai_schema.py, the same models /openapi.json
serves), the first problem as a BadParameter in OpenAI's terms: `param` the field's path as the body
spells it (`messages[0].role`), the message its value and why.

    body = validated(openai_schema.CompletionRequest, json_body)   # a CompletionRequest, or BadParameter

    unknown field        unrecognized request argument: extra=1
    a refused field      n=2 is not supported: aerie returns one choice per request (n=1)   (model.refusals)
    out of range         max_tokens must be >= 1 and <= 2147483647; got 0                   (the field's bounds)
    a validator's words  stop[0] is an empty string; a stop string needs at least one character   (a Problem)
    a wrong value        tokens[0]: Input should be a valid integer; got 'x'                (pydantic's words)
    a missing field      tokens is required

Every route with a body (/v1/completions, /v1/chat/completions, /tokenize, /detokenize) goes through
here; what a type cannot say, the models' validators raise as a Problem in aerie's words.
"""

from __future__ import annotations

from typing import Any, TypeVar

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

Body = TypeVar("Body", bound=BaseModel)
_MISSING = object()
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


class BadParameter(ValueError):
    """An invalid or unsupported request field (HTTP 400, `param` names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Problem(ValueError):
    """Raised by a model's validator: `message` in aerie's words, `param` the field it names, both
    relative to the model that raised it (`content[0] must be a text part ...`, param `content[0]`);
    the 400 prefixes both with the model's place in the body (`messages[0].`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validated(model: type[Body], body: Any) -> Body:
    """`body` as `model`, or BadParameter naming the first invalid field."""
    if not isinstance(body, dict):
        raise BadParameter("body", f"the request body must be a JSON object; got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_parameter(e.errors()[0], body, model) from None


def _path(loc: tuple, body: dict, kind: str) -> tuple[str, Any]:
    """(the body's spelling of `loc`, the value there). `loc` also holds the names of union members
    tried (`str`, `list[TextPart]`): only the steps that exist in the body make the path."""
    path: str = ""
    value: Any = body
    for step in loc:
        if isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}" if path else step, value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif kind in ("missing", "extra_forbidden") and isinstance(step, str):
            path, value = f"{path}.{step}" if path else step, _MISSING if kind == "missing" else value
    return path, value


def _bounds(model: type[BaseModel], name: str) -> str | None:
    """A top-level field's range as text (`>= 1 and <= 2147483647`), from its Field(ge=..., le=...)."""
    info = model.model_fields.get(name)
    words = {Ge: (">=", "ge"), Gt: (">", "gt"), Le: ("<=", "le"), Lt: ("<", "lt")}
    parts = [f"{words[type(m)][0]} {getattr(m, words[type(m)][1])}" for m in (info.metadata if info else ())
             if type(m) in words]
    return " and ".join(parts) or None


def bad_parameter(error: ErrorDetails, body: dict, model: type[BaseModel] | None = None) -> BadParameter:
    """One pydantic error -> BadParameter."""
    kind, loc = error["type"], error["loc"]
    root = loc[0] if loc and isinstance(loc[0], str) else None
    refusals = getattr(model, "refusals", {})
    if root is not None and root in refusals and root in body:  # a field aerie accepts only in its neutral value
        return BadParameter(root, f"{root}={show(body[root])} is not supported: {refusals[root]}")
    path, value = _path(loc, body, kind)
    problem = (error.get("ctx") or {}).get("error")
    if kind == "value_error" and isinstance(problem, Problem):
        # The model's place in the body: a field validator's loc ends at its field (messages[0].content
        # -> messages[0]), a model validator's at the model. At the top it is "" and the words stand alone.
        field = problem.param.split(".")[0].split("[")[0]
        prefix = path[:-len(field)].rstrip(".") if path.endswith(field) else path
        if not prefix:
            return BadParameter(problem.param, problem.message)
        return BadParameter(f"{prefix}.{problem.param}", f"{prefix}.{problem.message}")
    path = path or "body"
    if kind == "extra_forbidden":
        return BadParameter(path, f"unrecognized request argument: {path}={show(value)}")
    if kind == "missing" or value is _MISSING:
        return BadParameter(path, f"{path} is required")
    if kind == "literal_error":
        return BadParameter(path, f"{path}={show(value)} is not supported: {error['msg']}")
    if kind in _BOUNDS and model is not None and path == root and (bounds := _bounds(model, root)):
        return BadParameter(path, f"{path} must be {bounds}; got {show(value)}")
    return BadParameter(path, f"{path}: {error['msg']}; got {show(value)}")
