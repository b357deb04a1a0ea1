"""The served model's sampling defaults from its `generation_config.json`, as vLLM reads them
(`--generation-config auto`): temperature, top_p, top_k, min_p and repetition_penalty, each where the
file sets it. The HTTP API fills the fields a request leaves out from these, else OpenAI's defaults
(gateway/openai_request.py); the gRPC API takes requests as they are (an unset temperature is 0,
greedy). A GGUF file or a directory without the file has no defaults; a value out of range is
ignored with a warning rather than refusing every request.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from services.rpc.stubs import coordinator as cpb

log = logging.getLogger("aerie.coordinator")

# field -> (type, valid?) as SamplingParams checks it
_FIELDS = {
    "temperature": (float, lambda v: math.isfinite(v) and v >= 0),
    "top_p": (float, lambda v: 0 < v <= 1),
    "top_k": (int, lambda v: v >= 0),
    "min_p": (float, lambda v: 0 <= v <= 1),
    "repetition_penalty": (float, lambda v: math.isfinite(v) and v > 0),
}


def generation_defaults(source: str | None) -> cpb.GenerationDefaults:
    """The defaults in `<source>/generation_config.json` (source: the target's directory)."""
    out = cpb.GenerationDefaults()
    path = Path(source).expanduser() / "generation_config.json" if source else None
    if path is None or not path.is_file():
        return out
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s): OpenAI's sampling defaults apply", path, e)
        return out
    for name, (kind, valid) in _FIELDS.items():
        value = config.get(name) if isinstance(config, dict) else None
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and value != int(value) or not valid(value):
            log.warning("%s: %s=%r is out of range; ignored", path, name, value)
            continue
        setattr(out, name, kind(value))
    return out
