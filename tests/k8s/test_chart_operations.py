"""The chart as an operator reads it: the default image is the one docs/kubernetes.md builds, dtype
auto, the coordinator's probes and NOTES speak the HTTP API, autoscaling on aerie:num_requests_waiting
(an HPA through the external metrics API, or a KEDA ScaledObject) for every pool, Hub ids fetched by an
init container into a PVC cache, and drafters as a process in the verifier container (on its GPU).

Every new template is rendered here and validated: built-in kinds with `kubernetes-validate --strict`,
the ScaledObject against KEDA's vendored CRD schema (test_chart_valid.py). The init container's script
and the verifier+drafter supervisor script are run for real, against a local Hugging Face cache and
a stub `aerie` that records what each process was given.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.k8s.chart import CHART, ROOT, VALUE_SETS, Render, helm_notes, name, render, run_helm, template_args
from tests.k8s.test_chart_valid import CRD_SCHEMAS, kubernetes_validate, validate_crd

EXTERNAL_METRICS = ["--api-versions", "external.metrics.k8s.io/v1beta1"]
KEDA = ["--api-versions", "keda.sh/v1alpha1/ScaledObject", "--set", "autoscaling.engine=keda",
        "--set", "autoscaling.prometheusAddress=http://prometheus-operated.monitoring.svc:9090"]
ALL_AUTOSCALED = ["--set", "coordinator.autoscaling.enabled=true", "--set", "drafter.autoscaling.enabled=true",
                  "--set", "verifier.autoscaling.enabled=true", "--set", "coordinator.autoscaling.targetRequestsWaiting=4"]
IN_VERIFIER = ["--set", "drafter.placement=verifier"]


def assert_valid(r: Render, tmp_path: Path) -> None:
    """Every document passes kubernetes-validate --strict, or its vendored CRD schema."""
    builtin = [d for d in r.docs if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS]
    proc = kubernetes_validate(builtin, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARN" not in out and "ERROR" not in out, out
    assert proc.stdout.count("passed for resource") == len(builtin)
    for doc in r.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            validate_crd(doc)


def fails(helm: str, extra: list[str]) -> str:
    proc = run_helm(helm, *template_args([], extra), check=False)
    assert proc.returncode != 0, f"{extra} rendered"
    return proc.stderr


def images(r: Render) -> dict[str, str]:
    return {c: r.container(c)["image"] for c in ("coordinator", "drafter", "verifier")}


# --- the image ----------------------------------------------------------------------------------

def test_default_image_is_the_one_the_docs_build(helm, default_render):
    """aerie publishes no image: the default reference is what `docker build -t aerie:0.1.0 .` (CPU) and
    the CUDA build tagged -cu128 produce, as the Dockerfile and docs/kubernetes.md show."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    cpu, gpu = f"aerie:{version}", f"aerie:{version}-cu128"
    assert images(default_render) == {"coordinator": cpu, "drafter": gpu, "verifier": gpu}
    for doc in (ROOT / "Dockerfile", ROOT / "docs" / "kubernetes.md"):
        text = doc.read_text()
        assert f"docker build -t {cpu} ." in text, doc
        assert re.search(rf"docker build -t {re.escape(gpu)} .*TORCH_INDEX_URL=\S+/cu128", text, re.S), doc
    assert "docker push" in (ROOT / "docs" / "kubernetes.md").read_text()
    cpu_only = render(helm, [], ["--set", "drafter.gpu=0", "--set", "verifier.useGpu=false"])
    assert set(images(cpu_only).values()) == {cpu}
    pinned = render(helm, [], ["--set", "image.repository=registry.example.com/aerie", "--set", "image.tag=0.1.0-rc1"])
    assert set(images(pinned).values()) == {"registry.example.com/aerie:0.1.0-rc1"}


# --- dtype auto ---------------------------------------------------------------------------------

@pytest.mark.parametrize("service", ["verifier_svc", "drafter_svc"])
def test_dtype_auto_reaches_the_services_as_their_device_default(default_render, monkeypatch, service):
    """AERIE_DTYPE=auto (the default) is what the services read as "no --dtype": bf16 on cuda, fp32 on
    the CPU (services/rpc/config.py dtype_flag), never fp32 forced beside AERIE_DEVICE=cuda."""
    import importlib

    component = service.removesuffix("_svc")
    env = default_render.env(component)
    assert (env["AERIE_DTYPE"], env["AERIE_DEVICE"]) == ("auto", "cuda")
    monkeypatch.setenv("AERIE_DTYPE", env["AERIE_DTYPE"])
    config = importlib.import_module(f"{service}.config")
    p = argparse.ArgumentParser()
    config.add_flags(p)
    assert p.parse_args([]).dtype is None  # None = the device's default


# --- the HTTP API: probes and NOTES --------------------------------------------------------------

def test_coordinator_probes_ask_the_http_api(helm, default_render):
    """Startup: GET /metrics on the HTTP port (no token, no downstream call; HTTP starts after gRPC),
    HTTPS with TLS. Readiness: the gRPC health "" by default, vLLM's GET /health when asked. Liveness:
    the gRPC health name "liveness"."""
    plain = render(helm, [], ["--set", "security.tls.enabled=false"])
    for r, scheme in ((default_render, "HTTPS"), (plain, "HTTP")):
        c = r.container("coordinator")
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == 8000
        assert c["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "http", "scheme": scheme}
        assert set(c["readinessProbe"]) & {"grpc", "httpGet"} == {"grpc"}
        assert c["livenessProbe"]["grpc"]["service"] == "liveness"
    http = render(helm, VALUE_SETS["hub"]).container("coordinator")["readinessProbe"]
    assert http["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"} and "grpc" not in http
    assert "probes.coordinatorReadiness must be grpc or http" in fails(helm, ["--set", "probes.coordinatorReadiness=tcp"])


def test_notes_show_the_openai_http_api(helm):
    notes = helm_notes(helm, [])
    assert "port-forward svc/aerie-gateway 8000:8000" in notes  # the HTTP gateway (gateway.enabled)
    assert "curl --cacert aerie-ca.crt https://localhost:8000/health" in notes
    assert ('curl --cacert aerie-ca.crt -H "Authorization: Bearer $AERIE_API_TOKEN" '
            "https://localhost:8000/v1/chat/completions") in notes
    assert 'base_url="https://localhost:8000/v1", api_key=$AERIE_API_TOKEN' in notes
    assert "export AERIE_API_TOKEN=$(kubectl -n serving get secret aerie-api-tokens" in notes
    args = ["install", "aerie", str(CHART), "--dry-run=client", "--namespace", "serving",
            "--set", "security.tls.enabled=false", "--set", "security.apiTokens.enabled=false",
            "--set", "coordinator.httpPort=8080", "--set", "gateway.enabled=false"]
    plain = run_helm(helm, *args).stdout  # no gateway: the coordinators' own HTTP API
    assert "port-forward svc/aerie-coordinator 8080:8080" in plain
    assert "curl http://localhost:8080/v1/models" in plain and "Bearer" not in plain.split("Generate over gRPC")[0]


# --- autoscaling -----------------------------------------------------------------------------------

def test_waiting_gauge_name_is_the_one_the_coordinator_exports():
    from services import metrics

    assert metrics.REQUESTS_WAITING._name == "aerie:num_requests_waiting"
    assert "aerie:num_requests_waiting" in (ROOT / "docs" / "metrics.md").read_text()


def test_hpa_scales_every_pool_on_requests_waiting(helm, tmp_path):
    r = render(helm, [], ALL_AUTOSCALED + EXTERNAL_METRICS)
    assert_valid(r, tmp_path)
    assert "replicas" not in r.component("verifier")["spec"]  # left to the autoscaler
    for component, kind in (("coordinator", "Deployment"), ("drafter", "Deployment"), ("verifier", "StatefulSet")):
        hpa = r.get("HorizontalPodAutoscaler", name(component))
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": kind, "name": name(component)}
        [external] = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
        assert external["metric"] == {"name": "aerie_num_requests_waiting",
                                      "selector": {"matchLabels": {"namespace": "serving",
                                                                   "service": name("coordinator")}}}
        want = {"coordinator": "4", "drafter": "2", "verifier": "2"}[component]
        assert external["target"] == {"type": "AverageValue", "averageValue": want}
    cpu = [m for m in r.get("HorizontalPodAutoscaler", name("coordinator"))["spec"]["metrics"] if m["type"] == "Resource"]
    assert cpu[0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    verifier = r.get("HorizontalPodAutoscaler", name("verifier"))["spec"]
    assert (verifier["minReplicas"], verifier["maxReplicas"]) == (1, 4)
    assert verifier["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 600}}
    # The adapter rule the docs give serves exactly that external metric from exactly that series.
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert 'seriesQuery: \'aerie:num_requests_waiting' in docs and 'as: "aerie_num_requests_waiting"' in docs


def test_hpa_on_requests_waiting_needs_the_external_metrics_api(helm):
    message = fails(helm, ["--set", "verifier.autoscaling.enabled=true"])
    assert "needs the external metrics API (external.metrics.k8s.io/v1beta1" in message
    # CPU only needs nothing beyond autoscaling/v2.
    render(helm, [], ["--set", "coordinator.autoscaling.enabled=true"])
    assert "needs a signal" in fails(helm, ["--set", "verifier.autoscaling.enabled=true",
                                            "--set", "verifier.autoscaling.targetRequestsWaiting=0"])


def test_keda_scaled_objects_query_requests_waiting(helm, tmp_path):
    r = render(helm, [], ALL_AUTOSCALED + KEDA)
    assert_valid(r, tmp_path)
    assert r.kind("HorizontalPodAutoscaler") == []  # KEDA makes its own
    for component, kind in (("coordinator", "Deployment"), ("drafter", "Deployment"), ("verifier", "StatefulSet")):
        so = r.get("ScaledObject", name(component))
        assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": kind, "name": name(component)}
        prometheus = [t for t in so["spec"]["triggers"] if t["type"] == "prometheus"][0]
        assert prometheus["metricType"] == "AverageValue"
        assert prometheus["metadata"] == {
            "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
            "query": 'sum(aerie:num_requests_waiting{namespace="serving",service="aerie-coordinator"})',
            "threshold": {"coordinator": "4", "drafter": "2", "verifier": "2"}[component]}
    coordinator = r.get("ScaledObject", name("coordinator"))["spec"]["triggers"]
    assert {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "70"}} in coordinator
    verifier = r.get("ScaledObject", name("verifier"))["spec"]
    assert (verifier["minReplicaCount"], verifier["maxReplicaCount"]) == (1, 4)
    assert verifier["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == \
        {"stabilizationWindowSeconds": 600}
    custom = render(helm, [], ALL_AUTOSCALED + KEDA + ["--set", "autoscaling.query=sum(aerie:num_requests_running)"])
    assert custom.get("ScaledObject", name("verifier"))["spec"]["triggers"][0]["metadata"]["query"] == \
        "sum(aerie:num_requests_running)"
    # The vendored schema is strict: a misspelt trigger field is refused.
    bad = dict(r.get("ScaledObject", name("verifier")))
    bad["spec"] = {**bad["spec"], "maxReplicas": 4}
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(bad)


def test_keda_is_gated_on_its_crd_and_a_prometheus(helm):
    enabled = ["--set", "verifier.autoscaling.enabled=true", "--set", "autoscaling.engine=keda"]
    assert "needs KEDA's ScaledObject CRD (keda.sh/v1alpha1)" in fails(helm, enabled)
    assert "autoscaling.prometheusAddress is required" in fails(
        helm, enabled + ["--api-versions", "keda.sh/v1alpha1/ScaledObject"])
    assert "autoscaling.engine must be hpa or keda" in fails(helm, ["--set", "verifier.autoscaling.enabled=true",
                                                                    "--set", "autoscaling.engine=vpa"])


# --- models from the Hugging Face Hub ----------------------------------------------------------------

def init(r: Render, component: str) -> dict:
    [fetch] = [c for c in r.component(component)["spec"]["template"]["spec"]["initContainers"]
               if c["name"] == "fetch-model"]
    return fetch


def test_hub_models_are_fetched_into_a_pvc_by_an_init_container(helm, tmp_path):
    r = render(helm, VALUE_SETS["hub"])
    assert_valid(r, tmp_path)
    target, head = "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B"
    pvc = r.get("PersistentVolumeClaim", name("models"))
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs-client",
                           "resources": {"requests": {"storage": "60Gi"}}}
    assert init(r, "verifier")["args"] == [target]
    assert init(r, "drafter")["args"] == [target, head]
    for component in ("drafter", "verifier"):
        fetch = init(r, component)
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in fetch["env"]}
        assert env["AERIE_DOWNLOAD_DIR"] == "/models" and env["HF_HUB_OFFLINE"] == "0"
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert {"name": "models", "mountPath": "/models"} in fetch["volumeMounts"]
        assert fetch["image"] == r.container(component)["image"]  # no second image to pull
    for component in ("coordinator", "drafter", "verifier"):
        spec = r.component(component)["spec"]["template"]["spec"]
        [vol] = [v for v in spec["volumes"] if v["name"] == "models"]
        assert vol["persistentVolumeClaim"] == {"claimName": name("models")}
        [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models"]
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        env = r.env(component)
        assert env["AERIE_DOWNLOAD_DIR"] == "/models" and env["HF_HUB_OFFLINE"] == "1"
        assert "HF_TOKEN" not in env  # the token reaches the init container only
    assert r.env("verifier")["AERIE_TARGET"] == target and r.env("drafter")["AERIE_DRAFT"] == head
    mine = render(helm, VALUE_SETS["hub"], ["--set", "model.hub.existingClaim=my-cache"])
    assert mine.find("PersistentVolumeClaim", name("models")) is None
    spec = mine.component("verifier")["spec"]["template"]["spec"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if v["name"] == "models"] == ["my-cache"]


def test_hub_values_are_checked(helm):
    hub = ["--set", "model.source=hub"]
    assert "model.target must be a Hugging Face Hub id" in fails(helm, hub + ["--set", "model.target=Llama-3.1-8B"])
    assert "model.draft must be the Hub id of an EAGLE head" in fails(helm, hub + ["--set", "model.target=org/llama"])
    plain = render(helm, [], hub + ["--set", "model.target=org/llama@v1/model.Q8_0.gguf", "--set", "drafter.enabled=false"])
    assert init(plain, "verifier")["args"] == ["org/llama@v1/model.Q8_0.gguf"]


def fake_hub_cache(root: Path, repo: str) -> Path:
    """A Hugging Face cache holding one snapshot of `repo` (what `hf download` leaves behind)."""
    org, repo_name = repo.split("/")
    entry = root / f"models--{org}--{repo_name}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text("0123abcd")
    snapshot = entry / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    return snapshot


def run_fetch(fetch: dict, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """The init container's command as the kubelet runs it, with the image's python replaced by ours and
    the model volume by `cache`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AERIE_"))}
    environ |= {e["name"]: e["value"] for e in fetch["env"] if "value" in e}
    environ |= {"AERIE_DOWNLOAD_DIR": str(cache), "HF_HOME": str(cache.parent / "hf-home"), "PYTHONPATH": str(ROOT)}
    environ |= env
    assert fetch["command"][0] == "python"
    return subprocess.run([sys.executable, *fetch["command"][1:], *fetch["args"]], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_fetch_model_script_resolves_the_ids_into_the_cache(helm, tmp_path):
    """The rendered script finds models already in the cache without the network (a restarted pod,
    a second replica), and a model it cannot have fails the init container with one line naming it.
    (The download itself is huggingface_hub's; no test here reaches the network.)"""
    r = render(helm, VALUE_SETS["hub"])
    fetch = init(r, "drafter")
    cache = tmp_path / "cache"
    target = fake_hub_cache(cache, "meta-llama/Llama-3.1-8B-Instruct")
    head = fake_hub_cache(cache, "yuhuili/EAGLE-LLaMA3.1-Instruct-8B")
    ok = run_fetch(fetch, cache)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [f"target {target}", f"draft head {head}"]
    missing = run_fetch(init(render(helm, VALUE_SETS["hub"], ["--set", "model.target=org/not-cached"]), "verifier"),
                        cache, HF_HUB_OFFLINE="1")  # offline: a missing model must not reach the network here
    assert missing.returncode == 1
    assert missing.stderr.strip().startswith("fetch-model: model org/not-cached is neither a local path nor in "
                                             "the Hugging Face cache"), missing.stderr


# --- drafters on the verifier's GPU ------------------------------------------------------------------

def test_drafter_in_the_verifier_pod_shares_its_gpu(helm, tmp_path):
    r = render(helm, [], IN_VERIFIER + ["--set", "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus"])
    assert_valid(r, tmp_path)
    assert r.find("Deployment", name("drafter")) is None and r.find("PodDisruptionBudget", name("drafter")) is None
    assert r.find("NetworkPolicy", name("drafter")) is None
    verifier = r.container("verifier")
    assert verifier["resources"]["limits"]["nvidia.com/gpu"] == 1  # the group's GPU, and no other
    assert sum(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
               for w in r.workloads() for c in w["spec"]["template"]["spec"]["containers"]) == 1
    assert [e["configMapRef"]["name"] for e in verifier["envFrom"]] == [name("drafter"), name("verifier")]
    assert r.get("ConfigMap", name("drafter"))["data"]["AERIE_DEVICE"] == "cuda"
    ports = {p["name"]: p["containerPort"] for p in verifier["ports"]}
    assert (ports["drafter"], ports["drafter-metrics"]) == (50053, 9091)
    svc = r.get("Service", name("drafter"))
    assert svc["spec"]["selector"] == r.component("verifier")["spec"]["selector"]["matchLabels"]
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"grpc": "drafter", "metrics": "drafter-metrics"}
    assert r.env("coordinator")["AERIE_DRAFTERS"] == "aerie-drafter.serving.svc:50053"
    [policy] = [p for p in r.kind("NetworkPolicy") if p["metadata"]["name"] == name("verifier")]
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == ["grpc", "drafter"]
    assert [p["port"] for p in policy["spec"]["ingress"][1]["ports"]] == ["metrics", "drafter-metrics"]
    notes = run_helm(helm, "install", "aerie", str(CHART), "--dry-run=client", "--namespace", "serving",
                     *IN_VERIFIER).stdout
    assert "drafters         one process in every verifier container, on its GPU" in notes
    assert "drafter.placement must be pool, verifier or colocated" in fails(helm, ["--set", "drafter.placement=sidecar"])


def test_drafter_colocated_in_the_verifier_process(helm, tmp_path):
    """drafter.placement colocated: no drafter objects at all; every verifier process serves the head
    (AERIE_VERIFIER_DRAFT, the drafter.tree shape) and the verifiers' own address is the drafter pool,
    so the coordinator's placement finds each sequence's drafter in its verifier's process."""
    r = render(helm, [], ["--set", "drafter.placement=colocated", "--set", "drafter.tree.topK=4",
                          "--set", "drafter.tree.depth=3", "--set", "drafter.tree.tokens=16"])
    assert_valid(r, tmp_path)
    for kind in ("Deployment", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"):
        assert r.find(kind, name("drafter")) is None, kind
    env = r.env("verifier")
    assert env["AERIE_VERIFIER_DRAFT"] == "auto"  # model.draft unset: the shipped head, as drafters default to
    assert (env["AERIE_TREE_TOP_K"], env["AERIE_TREE_DEPTH"], env["AERIE_TREE_TOKENS"]) == ("4", "3", "16")
    coordinator = r.env("coordinator")
    assert coordinator["AERIE_DRAFTERS"] == coordinator["AERIE_VERIFIERS"] == "aerie-verifier.serving.svc:50052"
    assert r.container("verifier").get("command") is None  # one process: `aerie verifier` itself
    with_head = render(helm, [], ["--set", "drafter.placement=colocated", "--set", "model.draft=heads/h"])
    assert with_head.env("verifier")["AERIE_VERIFIER_DRAFT"] == "/models/heads/h"
    notes = run_helm(helm, "install", "aerie", str(CHART), "--dry-run=client", "--namespace", "serving",
                     "--set", "drafter.placement=colocated").stdout
    assert "drafters         the verifiers themselves" in notes
    assert "colocated needs verifier.tpSize 1" in fails(helm, ["--set", "drafter.placement=colocated", "--set",
                                                              "verifier.tpSize=2", "--set", "verifier.useGpu=true"])


def test_direct_drafts_admit_verifier_pods_to_drafters(helm, tmp_path):
    """coordinator.directDrafts: AERIE_DIRECT_DRAFTS=1, and the drafters' NetworkPolicy admits the
    verifier pods too (they send the Drafts); off, only coordinators."""
    def drafter_peers(r: Render, component: str = "drafter") -> list[str]:
        [policy] = [p for p in r.kind("NetworkPolicy") if p["metadata"]["name"] == name(component)]
        return [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for peer in policy["spec"]["ingress"][0]["from"]]

    r = render(helm, [], ["--set", "coordinator.directDrafts=true"])
    assert_valid(r, tmp_path)
    assert r.env("coordinator")["AERIE_DIRECT_DRAFTS"] == "1"
    assert drafter_peers(r) == ["coordinator", "verifier"] and drafter_peers(r, "verifier") == ["coordinator"]
    off = render(helm, [], [])
    assert off.env("coordinator")["AERIE_DIRECT_DRAFTS"] == "0" and drafter_peers(off) == ["coordinator"]
    in_verifier = render(helm, [], IN_VERIFIER + ["--set", "coordinator.directDrafts=true"])
    assert drafter_peers(in_verifier, "verifier") == ["coordinator", "verifier"]


STUB = """#!{python}
import os, signal, sys
role = sys.argv[1]
out = os.environ["STUB_OUT"]
with open(os.path.join(out, role + ".env"), "w") as f:
    f.write("\\n".join(f"{{k}}={{v}}" for k, v in sorted(os.environ.items())))
code = os.environ.get("STUB_EXIT_" + role)
if code is not None:
    sys.exit(int(code))
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
open(os.path.join(out, role + ".ready"), "w").close()
signal.sigwait([signal.SIGTERM])
open(os.path.join(out, role + ".terminated"), "w").close()
"""


def supervisor(r: Render, tmp_path: Path, **env: str) -> subprocess.Popen:
    """The verifier container's bash command with `aerie` a stub that records its environment, the
    container's env from its ConfigMaps, and $(POD_IP) expanded as the kubelet does."""
    c = r.container("verifier")
    assert c["command"] == ["/bin/bash", "-c"]
    environ = {"PATH": f"{tmp_path}:/usr/bin:/bin", "STUB_OUT": str(tmp_path), "POD_IP": "10.1.2.3"}
    for src in c["envFrom"]:
        environ |= r.get("ConfigMap", src["configMapRef"]["name"])["data"]
    environ |= env
    script = re.sub(r"\$\((\w+)\)", lambda m: environ.get(m.group(1), m.group(0)), c["args"][0])
    stub = tmp_path / "aerie"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    return subprocess.Popen(["/bin/bash", "-c", script], env=environ)


def recorded(tmp_path: Path, role: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (tmp_path / f"{role}.env").read_text().splitlines())


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Until `path` exists (the stub wrote it) or the script ended; no fixed sleep decides anything."""
    import time

    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, f"script ended before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_verifier_container_runs_both_processes_and_stops_both(helm, tmp_path):
    """SIGTERM reaches both processes (each drains), and the drafter gets its own settings where it
    shares a name with the verifier."""
    r = render(helm, [], IN_VERIFIER + ["--set", "drafter.maxSequences=48", "--set", "drafter.idleTtlSeconds=900"])
    proc = supervisor(r, tmp_path)
    try:
        wait_for(tmp_path / "drafter.ready", proc)
        wait_for(tmp_path / "verifier.ready", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert (tmp_path / "drafter.terminated").exists() and (tmp_path / "verifier.terminated").exists()
    drafter, verifier = recorded(tmp_path, "drafter"), recorded(tmp_path, "verifier")
    assert {k: drafter[k] for k in ("AERIE_MAX_SEQUENCES", "AERIE_IDLE_TTL_S", "AERIE_METRICS_PORT",
                                    "AERIE_HEALTH_PORT", "AERIE_ADVERTISE_ADDRESS", "OTEL_SERVICE_NAME",
                                    "AERIE_DRAFTER_PORT", "AERIE_DEVICE")} == {
        "AERIE_MAX_SEQUENCES": "48", "AERIE_IDLE_TTL_S": "900", "AERIE_METRICS_PORT": "9091",
        "AERIE_HEALTH_PORT": "8087", "AERIE_ADVERTISE_ADDRESS": "10.1.2.3:50053",
        "OTEL_SERVICE_NAME": "aerie-drafter", "AERIE_DRAFTER_PORT": "50053", "AERIE_DEVICE": "cuda"}
    assert {k: verifier[k] for k in ("AERIE_MAX_SEQUENCES", "AERIE_IDLE_TTL_S", "AERIE_METRICS_PORT",
                                     "OTEL_SERVICE_NAME", "AERIE_VERIFIER_PORT", "AERIE_DEVICE")} == {
        "AERIE_MAX_SEQUENCES": "64", "AERIE_IDLE_TTL_S": "600", "AERIE_METRICS_PORT": "9090",
        "OTEL_SERVICE_NAME": "aerie-verifier", "AERIE_VERIFIER_PORT": "50052", "AERIE_DEVICE": "cuda"}


@pytest.mark.parametrize("dies", ["drafter", "verifier"])
def test_either_process_exiting_restarts_the_container(helm, tmp_path, dies):
    """The first process to exit ends the container with its status, after the other is stopped, so the
    kubelet restarts both (a verifier pod never runs on without its drafter, or the reverse)."""
    r = render(helm, [], IN_VERIFIER)
    proc = supervisor(r, tmp_path, **{f"STUB_EXIT_{dies}": "3"})
    try:
        assert proc.wait(timeout=60) == 3
    finally:
        proc.kill()
    other = "verifier" if dies == "drafter" else "drafter"
    # The other process either was stopped by SIGTERM or had not started waiting yet; it never outlives
    # the container: its stub writes .ready before blocking, so a .ready without .terminated would mean
    # it was left running.
    if (tmp_path / f"{other}.ready").exists():
        assert (tmp_path / f"{other}.terminated").exists()
