"""The documentation states the code's defaults: docs/distributed.md's configuration table against
the parsers' defaults, and the README's bad-input example against the default model's vocabulary."""

import argparse
import re
from pathlib import Path

import pytest

from aerie_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("verifier", "drafter", "coordinator")


def parser_defaults(command: str) -> dict[str, object]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: a.default for a in sub.choices[command]._actions for opt in a.option_strings}


def table_rows():
    for line in (ROOT / "docs" / "distributed.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`AERIE_"):
            yield cells


def documented_defaults():
    """(command, flag, documented value) for every literal default in the table."""
    out = []
    for _, flags, roles, default in table_rows():
        commands = SERVICES if roles == "all" else tuple(r.strip() for r in roles.split(","))
        if not set(commands) <= set(SERVICES):
            continue
        flag_list = [f.strip("` ") for f in flags.split(",")]
        if flag_list == ["--tree-*"]:
            flag_list = ["--tree-top-k", "--tree-depth", "--tree-tokens"]
        values = [v.strip("` ") for v in re.split(r"[;(]", default)[0].split(",")]
        if not all(re.fullmatch(r"[\w.:/-]+", v) for v in values) or values == ["empty"]:
            continue  # a description ("the shipped head ..."), not a literal
        for i, command in enumerate(commands):
            for j, flag in enumerate(flag_list):
                value = values[j] if len(flag_list) > 1 else values[i] if len(values) > 1 else values[0]
                out.append((command, flag, value))
    return out


def test_the_table_is_parsed():
    found = {(c, f) for c, f, _ in documented_defaults()}
    assert ("drafter", "--dtype") in found and ("verifier", "--max-sequences") in found
    assert ("drafter", "--tree-tokens") in found and ("coordinator", "--rpc-timeout-s") in found


@pytest.mark.parametrize("command,flag,value", documented_defaults(), ids=lambda x: str(x))
def test_documented_default_is_the_code_default(monkeypatch, command, flag, value):
    import os

    for name in [n for n in os.environ if n.startswith("AERIE_")]:
        monkeypatch.delenv(name)  # the variables would override the built-in defaults
    actual = parser_defaults(command)[flag]
    if value in ("off", "unset"):
        assert actual is None
    else:
        assert str(actual) == value or (isinstance(actual, float) and float(value) == actual), (actual, value)


def test_readme_bad_input_example_is_outside_the_vocabulary():
    text = (ROOT / "README.md").read_text()
    m = re.search(r"prompt token id (\d+) at position \d+ is outside the vocabulary \[0, (\d+)\)", text)
    assert m and int(m.group(1)) >= int(m.group(2)) == 49152  # the default model's vocabulary


def test_cited_documents_exist():
    """Every .md file the docs, the chart and the code cite is in the repository (the chart cited the
    design document, which is not in it); eagle.md is the EAGLE reference spec outside the repository."""
    cited = set()
    for pattern in ("README.md", "docs/*.md", "k8s/**/*.yaml", "k8s/**/*.tpl", "k8s/**/*.txt",
                    "**/*.py"):
        for path in ROOT.glob(pattern):
            if ".venv" in path.parts or "node_modules" in path.parts:
                continue
            cited |= set(re.findall(r"[\w./-]+\.md\b", path.read_text(errors="replace")))
    missing = sorted(c for c in cited if not c.startswith("../") and Path(c).name != "eagle.md"
                     and not (ROOT / c).exists() and not (ROOT / "docs" / c).exists())
    assert missing == []
