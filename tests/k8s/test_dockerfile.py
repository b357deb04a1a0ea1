"""The Dockerfile, read rather than built (no Docker engine in CI): the final stage runs as a non-root
numeric USER, torch is installed first with the same pin as scripts/setup.sh and from a build-arg
index (CPU by default), the package is installed after it, and the entrypoint is `aerie`. The image's
user matches the chart's securityContext."""

from __future__ import annotations

import json
import re
import shlex

import yaml

from tests.k8s.chart import CHART, ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return out


def stages(ins: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for i in ins:
        if i[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(i)
    return result


def build_args(stage: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for word, rest in stage:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v.strip('"')
    return args


def setup_sh_torch_pin() -> str:
    m = re.search(r'torch==([0-9][^"\s]*)', (ROOT / "scripts" / "setup.sh").read_text())
    assert m, "scripts/setup.sh pins no torch"
    return m.group(1)


def test_dockerfile_is_multi_stage_and_final_stage_runs_as_non_root():
    all_stages = stages(instructions(DOCKERFILE.read_text()))
    assert len(all_stages) >= 2
    final = all_stages[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the final stage sets no USER (it would run as root)"
    user = users[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid; got {user}"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    # The chart runs the pods as the same uid/gid.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["securityContext"]["runAsUser"] == int(uid)
    if gid:
        assert values["securityContext"]["runAsGroup"] == int(gid)
    # and the user exists in the image.
    runs = " ".join(rest for word, rest in final if word == "RUN")
    assert re.search(rf"useradd .*--uid {uid}\b", runs)


def test_torch_is_pinned_like_setup_sh_and_installed_before_the_package():
    build = stages(instructions(DOCKERFILE.read_text()))[0]
    args = build_args(build)
    assert args.get("TORCH_VERSION") == setup_sh_torch_pin()
    assert args.get("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    pip_runs = [rest for word, rest in build if word == "RUN" and "pip install" in rest]
    torch_at = next(i for i, r in enumerate(pip_runs) if "torch==${TORCH_VERSION}" in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in pip_runs[torch_at]
    package_at = next(i for i, r in enumerate(pip_runs) if re.search(r"pip install (/src|\.)(\s|$)", r))
    assert torch_at < package_at, "torch must be installed before the package"
    assert all("torch" not in shlex.split(r) for r in pip_runs[package_at:])


def test_entrypoint_is_aerie():
    final = stages(instructions(DOCKERFILE.read_text()))[-1]
    [entrypoint] = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["aerie"]
    # The chart passes the subcommand as args.
    for component in ("coordinator", "drafter", "verifier"):
        assert f'args: ["{component}"]' in (CHART / "templates" / f"{component}.yaml").read_text()


def test_build_context_is_limited_by_dockerignore():
    lines = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*"
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for needed in ("pyproject.toml", "README.md", "LICENSE", "proto", *(p.rstrip("*") for p in packages)):
        assert f"!{needed}" in lines, needed  # every installed package, or the image lacks it
    missing = [l for l in lines if l.startswith("!") and not (ROOT / l[1:]).exists()]
    assert missing == []  # each file it lets in exists (LICENSE was named but absent)


def test_license_is_the_declared_one():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == "Apache-2.0" and "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
