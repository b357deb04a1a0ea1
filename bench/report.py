"""A measurement script's report: printed as JSON, and written to `path` when one is given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, path: str | None) -> None:
    text = json.dumps(report, indent=1)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
