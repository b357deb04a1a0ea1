"""Helpers for the Helm chart tests: find helm, render the chart with a value set (cached), and look
inside the rendered manifests. The fixtures built on them are in conftest.py.

No cluster is needed: everything runs on `helm lint` / `helm template` output. helm comes from
scripts/fetch-helm.sh (scripts/setup.sh runs it); when it is missing the tests fail, never skip.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "charts" / "aerie"
HERE = Path(__file__).resolve().parent
# Kubernetes version the manifests are validated against (kubernetes-validate has schemas for it).
KUBE_VERSION = "1.30.0"
RELEASE = "aerie"
NAMESPACE = "serving"

# name -> values files passed with -f, in order.
VALUE_SETS: dict[str, list[Path]] = {
    "default": [],
    "scale": [HERE / "values-scale.yaml"],
    "external-redis": [HERE / "values-external-redis.yaml"],
    "hub": [HERE / "values-hub.yaml"],
}


def find_helm() -> str | None:
    """$HELM, then .venv/bin/helm and tools/bin/helm (where scripts/fetch-helm.sh puts it), then PATH."""
    candidates = [os.environ.get("HELM"), ROOT / ".venv" / "bin" / "helm", ROOT / "tools" / "bin" / "helm",
                  shutil.which("helm")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def template_args(files: list[Path], extra: list[str] | None = None) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    for f in files:
        args += ["-f", str(f)]
    return args + (extra or [])


class Render:
    """One `helm template` output: the raw text and the parsed documents."""

    def __init__(self, text: str, values: dict):
        self.text = text
        self.values = values
        self.docs: list[dict] = [d for d in yaml.safe_load_all(text) if d]

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}; found {len(found)}"
        return found[0]

    def find(self, kind: str, name: str) -> dict | None:
        found = [d for d in self.kind(kind) if d["metadata"]["name"] == name]
        return found[0] if found else None

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]

    def component(self, component: str) -> dict:
        """The Deployment or StatefulSet of a component (coordinator, drafter, verifier, redis)."""
        return self.get("StatefulSet" if component in ("verifier", "redis") else "Deployment",
                        name(component))

    def container(self, component: str) -> dict:
        return self.component(component)["spec"]["template"]["spec"]["containers"][0]

    def env(self, component: str) -> dict[str, object]:
        """The container's environment as Kubernetes builds it: envFrom ConfigMaps, then env
        (plain values as strings, valueFrom entries as their dict)."""
        c = self.container(component)
        env: dict[str, object] = {}
        for src in c.get("envFrom", []):
            cm = self.get("ConfigMap", src["configMapRef"]["name"])
            env.update({src.get("prefix", "") + k: v for k, v in cm["data"].items()})
        for e in c.get("env", []):
            env[e["name"]] = e["value"] if "value" in e else e["valueFrom"]
        return env


def name(component: str) -> str:
    return f"{RELEASE}-{component}"


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def merged_values(files: list[Path]) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in files:
        values = deep_merge(values, yaml.safe_load(f.read_text()) or {})
    return values


def helm_notes(helm: str, files: list[Path]) -> str:
    """NOTES.txt as `helm install --dry-run=client` prints it (helm template does not render it)."""
    args = ["install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE]
    for f in files:
        args += ["-f", str(f)]
    out = run_helm(helm, *args).stdout
    return out[out.index("NOTES:"):]


_cache: dict[tuple, Render] = {}


def render(helm: str, files: list[Path], extra: list[str] | None = None) -> Render:
    key = (tuple(map(str, files)), tuple(extra or []))
    if key not in _cache:
        text = run_helm(helm, *template_args(files, extra)).stdout
        _cache[key] = Render(text, merged_values(files))
    return _cache[key]
