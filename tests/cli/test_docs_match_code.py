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


# --- the README's and the docs' commands against the CLI --------------------------------------------

DOCS_WITH_COMMANDS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
SUBCOMMANDS = ("generate", "up", "bench", "verifier", "drafter", "coordinator", "train-draft", "draft-vocab")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def command_lines(block: str) -> list[str]:
    """One string per shell command: continuation lines joined, comments dropped, `&&` split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.extend(part.strip() for part in line.split("&&"))
    return out


def aerie_argv(command: str) -> list[str] | None:
    """The argv after `aerie` when the command runs the aerie CLI (env assignments and a trailing &
    stripped), else None."""
    import shlex

    if not re.match(r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?aerie\s", command):
        return None
    words = shlex.split(command.rstrip("&").strip())
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if not words or words[0] not in ("aerie", ".venv/bin/aerie"):
        return None
    return words[1:]


def documented_invocations():
    out = []
    for name in DOCS_WITH_COMMANDS:
        text = (ROOT / name).read_text()
        for block in bash_blocks(text):
            for command in command_lines(block):
                argv = aerie_argv(command)
                if argv and argv[0] in SUBCOMMANDS and not any(w == "..." or w.startswith("[") for w in argv):
                    out.append((name, command))
        for span in re.findall(r"`(\.venv/bin/aerie [^`]+)`", text):
            if "[" not in span and "..." not in span:
                out.append((name, span))
    return out


def test_the_documented_commands_are_found():
    found = documented_invocations()
    readme = [c for n, c in found if n == "README.md"]
    assert any("aerie generate --prompt" in c for c in readme)
    assert any(" bench " in c and "--concurrency" in c for c in readme)
    assert any(" up" in c for c in readme)
    assert sum(n == "docs/benchmarks.md" for n, _ in found) >= 6


@pytest.mark.parametrize("doc,command", documented_invocations(), ids=lambda x: str(x)[:80])
def test_documented_command_parses(doc, command):
    """Every aerie command in the README and the docs names a real subcommand, real flags and valid
    choices: argparse exits (code 2) on anything else."""
    build_parser().parse_args(aerie_argv(command))


def test_quick_start_commands_equal_the_code():
    """The README's two commands: setup-and-run (a generate that parses) and the test command, which
    is exactly what CI runs (.ci/run's last line)."""
    blocks = [command_lines(b) for b in bash_blocks((ROOT / "README.md").read_text())]
    run, test = blocks[0], blocks[1]
    assert run[0] == "bash scripts/setup.sh" and aerie_argv(run[1])[:2] == ["generate", "--prompt"]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert " && ".join(test) == ci[-1] == "bash scripts/setup.sh && .venv/bin/python -m pytest -q"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert ".venv" in setup and "AERIE_TORCH_INDEX" in setup  # the README's setup claims


def flag_table():
    """(commands, flag, default cell) for every row of the README's flag table."""
    rows = []
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`--[a-z-]+`", cells[1]):
            commands = ("generate", "up", "bench") if cells[0] == "all" else (cells[0].strip("`"),)
            rows.append((commands, cells[1].strip("`"), cells[2]))
    return rows


def test_the_flag_table_is_parsed():
    rows = {(c, f) for cs, f, _ in flag_table() for c in cs}
    assert {("generate", "--max-new-tokens"), ("up", "--http-port"), ("bench", "--concurrency-methods"),
            ("up", "--device"), ("bench", "--draft")} <= rows


@pytest.mark.parametrize("commands,flag,default", flag_table(), ids=lambda x: str(x))
def test_readme_flag_default_is_the_code_default(monkeypatch, commands, flag, default):
    """A default written as one `literal` is the parser's default; "off" is a switch that is off; any
    other words describe a default the command computes at run time (the parser's default is None)."""
    import os

    for name in [n for n in os.environ if n.startswith("AERIE_")]:
        monkeypatch.delenv(name)
    for command in commands:
        defaults = parser_defaults(command)
        assert flag in defaults, f"aerie {command} has no {flag}"
        actual = defaults[flag]
        if re.fullmatch(r"`[^`]+`", default):
            assert str(actual) == default.strip("`"), (command, flag, actual, default)
        elif default == "off":
            assert actual is False, (command, flag, actual)
        else:
            assert actual is None, (command, flag, actual, default)


CITED_PATH = re.compile(r"(?<![\w/.~-])((?:bench|scripts|services|docs|tests|coordinator|aerie_cli|gateway|k8s|proto)"
                        r"/[\w./-]*[\w/])")


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
                                 "bench/results/README.md"])
def test_cited_repository_paths_exist(doc):
    """Every repository path the README and the docs cite (results, scripts, modules, tests) exists
    (`module.name` cites a module's attribute; .md files are test_cited_documents_exist's)."""
    base = ROOT / Path(doc).parent
    missing = []
    for path in CITED_PATH.findall((ROOT / doc).read_text()):
        path = path.rstrip(".")
        module = re.sub(r"\.\w+$", ".py", path)
        if path.endswith(".md") or any((d / p).exists() for d in (ROOT, base) for p in (path, module)):
            continue
        missing.append(path)
    assert missing == []


def test_readme_is_one_screen_with_its_picture():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "](docs/architecture.png)" in text and "docs/architecture.dot" in text
    assert (ROOT / "docs" / "architecture.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    source = (ROOT / "docs" / "architecture.dot").read_text()
    for box in ("coordinator", "redis", "drafter", "verifier", "gateway"):
        assert re.search(rf"^\s*{box} \[label=", source, re.M), box
