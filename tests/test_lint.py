"""The linter and the type checker run with the tests (configured in pyproject.toml, see
docs/testing.md): ruff over the whole repository (the full rule set on services/spec, services/model
and services/engine, correctness rules elsewhere) and mypy over those three packages. Skipped, saying
so, only where the tool is not installed (`pip install -e ".[test]"` installs both)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess:
    # scripts/setup.sh installs both (the `test` extra pins them): a missing one is a failed setup, not a skip
    assert importlib.util.find_spec(module) is not None, (
        f"{module} is not installed in this Python ({sys.executable}): pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing() -> None:
    proc = run_tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow  # ~50 s cold (it reads torch's stubs); its cache makes reruns fast
def test_mypy_finds_nothing() -> None:
    proc = run_tool("mypy", "--python-executable", sys.executable)  # `files` and settings: pyproject.toml
    assert proc.returncode == 0, proc.stdout + proc.stderr
