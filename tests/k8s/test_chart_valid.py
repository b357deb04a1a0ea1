"""The chart is well-formed: `helm lint` passes, every rendered manifest passes
`kubernetes-validate --strict` against Kubernetes 1.30, the ServiceMonitor passes the vendored
prometheus-operator schema, and values.yaml documents every value.

NOTE: kubernetes-validate has no schema for CRDs; it only warns and passes them. The CRDs the chart
renders (monitoring.coreos.com/v1 ServiceMonitor, keda.sh/v1alpha1 ScaledObject) are therefore
validated here against the openAPIV3Schemas vendored in tests/k8s/schemas/ (see its README), made
strict the way the API server's strict field validation is: unknown fields are rejected.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.k8s.chart import CHART, HERE, KUBE_VERSION, VALUE_SETS, run_helm, template_args

KUBERNETES_VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): HERE / "schemas" / "servicemonitor-monitoring.coreos.com-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): HERE / "schemas" / "scaledobject-keda.sh-v1alpha1.json",
}


def strict_schema(schema: dict) -> dict:
    """Copy of an openAPIV3 schema where objects with declared properties reject unknown ones
    (unless they say x-kubernetes-preserve-unknown-fields)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def validate_crd(doc: dict) -> None:
    path = CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]
    schema = strict_schema(json.loads(path.read_text()))
    jsonschema.Draft7Validator(schema).validate(doc)


def kubernetes_validate(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    f = tmp_path / "manifests.yaml"
    f.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    assert KUBERNETES_VALIDATE.is_file(), f"{KUBERNETES_VALIDATE} missing: pip install -e '.[test]'"
    return subprocess.run([str(KUBERNETES_VALIDATE), "-k", KUBE_VERSION, "--strict", str(f)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_helm_lint_strict(helm, value_set):
    args = ["lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    for f in VALUE_SETS[value_set]:
        args += ["-f", str(f)]
    out = run_helm(helm, *args).stdout
    assert "0 chart(s) failed" in out, out


def test_every_manifest_passes_kubernetes_validate_strict(rendered, tmp_path):
    builtin = [d for d in rendered.docs if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS]
    proc = kubernetes_validate(builtin, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every document was checked against a schema: no "couldn't find schema" warnings, no errors.
    assert "WARN" not in proc.stdout + proc.stderr and "ERROR" not in proc.stdout + proc.stderr, proc.stdout
    assert proc.stdout.count("passed for resource") == len(builtin)
    for doc in rendered.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            validate_crd(doc)


def test_strict_validation_rejects_unknown_fields(scale_render, tmp_path):
    """Negative control: the validators above do reject a misspelt field."""
    deployment = copy.deepcopy(scale_render.get("Deployment", "aerie-drafter"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 1}
    proc = kubernetes_validate([deployment], tmp_path)
    assert proc.returncode != 0, proc.stdout
    monitor = copy.deepcopy(scale_render.kind("ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(monitor)


def test_service_monitor_is_optional(default_render, scale_render):
    assert default_render.kind("ServiceMonitor") == []
    [monitor] = scale_render.kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # It selects exactly the aerie Services, each of which has a port named metrics.
    selected = [s for s in scale_render.kind("Service")
                if s["metadata"]["labels"]["app.kubernetes.io/component"]
                in monitor["spec"]["selector"]["matchExpressions"][0]["values"]]
    assert {s["metadata"]["name"] for s in selected} == {"aerie-coordinator", "aerie-drafter", "aerie-verifier"}
    for s in selected:
        assert "metrics" in [p["name"] for p in s["spec"]["ports"]]


def test_values_yaml_documents_every_value():
    """Every key in values.yaml has a comment line directly above it. Inside a Kubernetes object
    passed through whole (resources: requests/limits), the comment above the object covers it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    raw_until = None  # indentation of the `resources:` key we are inside, if any
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        if raw_until is not None:
            if indent > raw_until:
                continue
            raw_until = None
        if stripped.startswith("-") or ":" not in stripped:
            continue
        if not lines[i - 1].strip().startswith("#"):
            undocumented.append(f"values.yaml:{i + 1}: {stripped}")
        if stripped == "resources:":
            raw_until = indent
    assert not undocumented, "values without a comment above them:\n" + "\n".join(undocumented)


def test_bad_values_fail_loudly(helm):
    """Misconfigurations stop `helm template` with a message naming the value."""
    cases = {
        "externalRedis.url is required": ["--set", "redis.enabled=false"],
        "without credentials": ["--set", "redis.enabled=false",
                                "--set", "externalRedis.url=redis://:hunter2@redis:6379/0"],
        "model.pvc.claimName is required": ["--set", "model.source=pvc"],
        "model.source must be one of": ["--set", "model.source=s3"],
        "verifier.tpSize must be >= 1": ["--set", "verifier.tpSize=0"],
        "must exceed config.drainSeconds": ["--set", "config.drainSeconds=60"],
    }
    for message, extra in cases.items():
        proc = run_helm(helm, *template_args([], extra), check=False)
        assert proc.returncode != 0 and message in proc.stderr, (extra, proc.stderr)
