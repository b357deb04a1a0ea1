"""The CLI's shape: `services` never imports the service packages or the CLI, building the parser
(every `--help`) imports no torch/grpc/redis, every flag shows its default, `--version` works."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aerie_cli.flags import HelpFormatter
from aerie_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "grpc", "redis", "transformers", "tokenizers", "numpy")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):  # function-level (lazy) imports count too
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_services_never_imports_the_service_packages_or_the_cli():
    forbidden = {"coordinator", "drafter_svc", "verifier_svc", "aerie_cli"}
    offenders = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & forbidden)
                 for p in (ROOT / "services").rglob("*.py") if "/gen/" not in str(p)}
    assert {p: v for p, v in offenders.items() if v} == {}


def test_the_walk_sees_a_lazy_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from coordinator.up import cmd_up\n    import drafter_svc.server\n")
    assert imported_packages(bad) == {"coordinator", "drafter_svc"}


def commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_commands_are_registered():
    assert commands() == ["bench", "coordinator", "draft-vocab", "drafter", "gateway", "generate", "serve", "train-draft",
                          "up", "verifier"]


@pytest.mark.parametrize("argv", [[]] + [[c] for c in commands()], ids=lambda a: " ".join(a) or "aerie")
def test_help_imports_nothing_heavy(argv):
    code = ("import json, sys\nfrom aerie_cli.main import main\n"
            f"try:\n    main({argv + ['--help']!r})\nexcept SystemExit as e:\n    code = e.code\n"
            f"print(json.dumps([code, sorted(m for m in {HEAVY!r} if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    code, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert code == 0 and heavy == []


def loaded_twice(module: str, argv: list[str], path: Path = ROOT) -> list[str]:
    """Run `python -m module *argv` (through runpy's own entry for -m) and list every source file that
    two entries of sys.modules share (a CLI module run as __main__ and imported again by name)."""
    code = ("import collections, json, runpy, sys\n"
            f"sys.path.insert(0, {str(path)!r}); sys.argv = [{module!r}, *{argv!r}]\n"
            f"try:\n    runpy._run_module_as_main({module!r})\nexcept SystemExit:\n    pass\n"
            "files = collections.Counter(getattr(m, '__file__', None) for m in list(sys.modules.values()))\n"
            f"print(json.dumps(sorted(f for f, n in files.items() if f and n > 1 and f.startswith({str(path)!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_python_m_aerie_cli_loads_each_module_once():
    assert loaded_twice("aerie_cli", ["generate", "--help"]) == []
    assert loaded_twice("aerie_cli", ["up", "--help"]) == []


def test_the_loaded_twice_check_can_fail(tmp_path):
    pkg = tmp_path / "twice"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("import twice.other\n")
    (pkg / "other.py").write_text("import twice.cli\n")  # the old services.cli <-> coordinator.cli circle
    assert loaded_twice("twice.cli", [], tmp_path) == [str(pkg / "cli.py")]


def test_every_flag_has_help_that_shows_its_default():
    missing = []
    for name in commands():
        parser = build_parser()._subparsers._group_actions[0].choices[name]
        formatter = HelpFormatter(prog=name)
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            if not action.option_strings:
                continue
            text = formatter._get_help_string(action) if action.help else ""
            if "default" not in text.lower() and "required" not in text.lower():
                missing.append(f"{name} {action.option_strings[0]}: {action.help!r}")
            if text.count("default:") > 1:  # a help that names its default gets no second one
                missing.append(f"{name} {action.option_strings[0]} twice: {text!r}")
    assert missing == []


def flag_section(help_text: str) -> str:
    """The flag descriptions of a --help output (after the usage block), whitespace-normalised."""
    return " ".join(help_text.split("\noptions:", 1)[1].split())


def test_help_output_shows_defaults_of_the_named_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = flag_section(capsys.readouterr().out)
    for flag, default in [("--max-new-tokens", "128"), ("--top-p", "1.0"), ("--top-k", "0"), ("--seed", "0")]:
        assert f"{flag} " in out and f"(default: {default})" in out.split(flag, 1)[1].split("--", 1)[0], flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-draft", "--help"])
    out = flag_section(capsys.readouterr().out)
    for flag, default in [("--steps", "2000"), ("--lr", "0.001"), ("--batch-size", "4")]:
        assert f"(default: {default})" in out.split(flag + " ", 1)[1].split("--", 1)[0], flag


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"aerie {version('aerie')}"


def test_dtype_names_match_the_engine():
    from services.engine.local import DTYPES
    from services.rpc.config import DTYPE_NAMES

    assert sorted(DTYPES) == sorted(DTYPE_NAMES)


def test_head_kind_choices_are_the_one_head_kind_type():
    """`--kind` of `aerie train-draft` and of the training pipeline offers exactly HeadKind's values
    (services/model/head_kind.py), the type HeadConfig.kind and checkpoint loading use."""
    from typing import get_args

    from services.model.eagle_head import HeadConfig
    from services.model.head_kind import HEAD_KINDS, HeadKind
    from services.train.pipeline import add_args

    assert HEAD_KINDS == get_args(HeadKind) == ("eagle", "eagle3")
    assert HeadConfig.__annotations__["kind"] == "HeadKind"  # (postponed annotations: its name)
    train_draft = build_parser()._subparsers._group_actions[0].choices["train-draft"]
    pipeline = argparse.ArgumentParser()
    add_args(pipeline)
    for parser in (train_draft, pipeline):
        (kind,) = [a for a in parser._actions if a.dest == "kind"]
        assert tuple(kind.choices) == HEAD_KINDS and kind.default in HEAD_KINDS
