"""What the chart promises, checked on rendered manifests: pool sizes follow their own values, verifier
groups get tpSize GPUs, the Redis password is never in plain text, every container is locked down,
every AERIE_* setting carries its values.yaml value, probes are gRPC, NetworkPolicies admit only the
coordinator to drafters, verifiers and Redis, and an external Redis replaces the StatefulSet.
"""

from __future__ import annotations

import base64
import re

import pytest

from tests.k8s.chart import NAMESPACE, RELEASE, ROOT, VALUE_SETS, Render, helm_notes, name, render

AERIE = ("coordinator", "drafter", "verifier")

# The settings each service reads (the services' configuration contract). The chart must set each
# one from values.yaml; expected_env() below says from which value.
# drafters and verifiers, while coordinator.discoverRegistered is "1"
REGISTRATION = ("AERIE_REDIS_URL", "AERIE_ADVERTISE_ADDRESS", "AERIE_HEARTBEAT_S", "AERIE_HEARTBEAT_TTL_S")
CONTRACT = {
    "common": {"AERIE_HOST", "AERIE_LOG_LEVEL", "AERIE_METRICS_PORT", "AERIE_MAX_MESSAGE_BYTES", "AERIE_DRAIN_S",
               "OTEL_EXPORTER_OTLP_ENDPOINT"},
    "verifier": {"AERIE_VERIFIER_PORT", "AERIE_TARGET", "AERIE_DTYPE", "AERIE_MAX_SEQUENCES",
                 "AERIE_MAX_PROMPT_TOKENS", "AERIE_TP_SIZE", "AERIE_IDLE_TTL_S", "AERIE_DEVICE",
                 "AERIE_TP_EXECUTOR", "AERIE_TP_TIMEOUT_S", *REGISTRATION},
    "drafter": {"AERIE_DRAFTER_PORT", "AERIE_TARGET", "AERIE_DRAFT", "AERIE_DTYPE", "AERIE_DEVICE", "AERIE_TREE_TOP_K",
                "AERIE_TREE_DEPTH", "AERIE_TREE_TOKENS", "AERIE_MAX_SEQUENCES", "AERIE_IDLE_TTL_S", *REGISTRATION},
    "coordinator": {"AERIE_COORDINATOR_PORT", "AERIE_REDIS_URL", "AERIE_DRAFTERS", "AERIE_VERIFIERS",
                    "AERIE_MAX_NEW_TOKENS", "AERIE_SEQUENCE_TTL_S", "AERIE_MAX_SEQUENCES", "AERIE_RPC_TIMEOUT_S",
                    "AERIE_RESOLVE_INTERVAL_S", "AERIE_RETRIEVAL", "AERIE_OVERLAP", "AERIE_VERIFIER_WAIT_S", "AERIE_PROBE_INTERVAL_S",
                    "AERIE_LEASE_TTL_S", "AERIE_FINISHED_TTL_S", "AERIE_REDIS_RETRY_S", "AERIE_DISCOVER",
                    "AERIE_DISCOVER_INTERVAL_S"},
}
# AERIE_* names the services read that the chart deliberately leaves unset (a user can still add
# them through <component>.extraEnv). Anything else the code reads must be mapped by the chart.
NOT_SET_BY_CHART = {
    "AERIE_TORCH_THREADS": "torch intra-op threads; torch's default follows the CPU limit",
    "AERIE_DEVICE_ROUND": "a switch for measurements (default on: the round on the GPU in process and in a verifier that drafts too)",
    "AERIE_PAGED_KV": "the GPU's paged paths run eagerly on the CPU (measurements, tests); CUDA pods are paged anyway",
    "AERIE_COORDINATOR": "client side: the default --coordinator of `aerie generate`, not a service setting",
    "AERIE_COST_DIR": "where measured cost curves are cached; a fresh pod measures its device (seconds)",
    "AERIE_RECALIBRATE": "force a new cost measurement; a fresh pod measures anyway",
    "AERIE_MAX_BATCH": "continuous batching (drafter, verifier); the defaults fit the chart's pods",
    "AERIE_MAX_BATCH_ROWS": "continuous batching: rows per forward; the default fits",
    "AERIE_BATCH_QUEUE": "continuous batching: calls waiting for a forward; the default fits",
    "AERIE_BATCH_QUEUE_TIMEOUT_S": "continuous batching: wait for a queue place; the default fits",
    "AERIE_BATCH_WAIT_MS": "continuous batching: gathering wait; the default fits",
    "AERIE_KV_BUDGET_MB": "verifier KV memory budget; unset = AERIE_KV_BUDGET_SHARE of free memory (cgroup-aware)",
    "AERIE_KV_BUDGET_SHARE": "verifier KV budget as a share of free memory at start; the default 0.5 fits a pod",
    "AERIE_KV_WAIT_S": "KV admission wait under --kv-budget-mb; the default fits",
    "AERIE_KV_QUEUE": "KV admission queue under --kv-budget-mb; the default fits",
    "AERIE_KV_GROWTH_ROWS": "KV growth increment of a sequence under the KV budget; the default fits",
    "AERIE_PREFILL_CHUNK": "chunked prefill: the code's measured default (512 tokens per chunk) fits",
    "AERIE_ITL_TARGET_MS": "step scheduler: a step's ITL target (off by default) slices prefill chunks by the pod's measured costs",
    "AERIE_KV_CLIENT_SHARE": "per-client share of the verifier KV budget while others want KV; the default 0.5 fits",
    # issue 9 (speed-model): the chart keeps the code's measured defaults (not mapped yet)
    "AERIE_DRAFT_VOCAB": "drafter: reduced draft vocabulary K; default 8192 when the head ships token counts",
    "AERIE_DRAFT_DTYPE": "drafter: the draft head's precision; default int8 (CPU)",
    "AERIE_WEIGHT_LAYOUT": "the linears' inference weight layout; default onednn (docs/design.md, Cheaper rounds)",
    # security (docs/security.md)
    "AERIE_API_TOKEN": "client side: the bearer token of `aerie generate --coordinator`",
    "AERIE_INTERNAL_TOKEN_FILE": "the chart passes the token itself from a Secret (AERIE_INTERNAL_TOKEN)",
    "AERIE_VERIFIER_DRAFT": "set with drafter.placement colocated only (tests/k8s/test_chart_operations.py); the "
                            "default placement runs a drafter pool",
    "AERIE_AHEAD_BRANCHES": "drafting ahead is off by default (coordinator.overlap); set it through extraEnv with it",
    "AERIE_MAX_TREE_NODES": "the drafters'/verifiers' own cap (512) is far above the budget's largest tree (32)",
    "AERIE_MAX_SEQUENCE_ROWS": "default: the target's context + one tree; set it through extraEnv to cap KV per sequence",
    # `aerie up` / `aerie serve` and GPU tuning knobs (the chart runs the services one by one)
    "AERIE_API_KEY": "`aerie up`/`aerie serve`'s --api-key; the chart gives coordinators AERIE_API_TOKENS_FILE",
    "AERIE_PROGRESS": "progress bars on stderr; off in a pod's log unless set through extraEnv",
    "AERIE_ATTENTION": "forces one attention backend (measurements, tests); the code picks per call",
    "AERIE_CUDA_GRAPHS": "CUDA graphs on GPU, on by default; extraEnv AERIE_CUDA_GRAPHS=0 runs eagerly",
    "AERIE_GRAPH_WARMUP": "CUDA graphs of common shapes captured at start, on by default; extraEnv AERIE_GRAPH_WARMUP=0 skips",
    "AERIE_FUSE": "compiled fused stages on GPU, on by default; extraEnv AERIE_FUSE=0 keeps them eager",
    "AERIE_OFFLINE": "the chart sets HF_HUB_OFFLINE=1 instead (the same switch, huggingface_hub's name)",
    # vLLM's serving limits (docs/cli.md): not values yet; extraEnv sets them
    "AERIE_MAX_MODEL_LEN": "verifier: vLLM's --max-model-len; default the model's context; extraEnv caps it",
    "AERIE_GPU_MEMORY_UTILIZATION": "verifier on CUDA: vLLM's KV sizing; the chart's pods use AERIE_KV_BUDGET_SHARE",
    "AERIE_MAX_QUEUED_REQUESTS": "coordinator admission queue length; the default (1024) fits",
    "AERIE_QUEUE_TIMEOUT_S": "coordinator admission queue wait; the default (600 s) fits",
}


def model_path(values: dict, p: str) -> str:
    """As the chart maps a model value: Hub ids (model.source hub) and absolute paths as given."""
    if values["model"]["source"] == "hub" or p.startswith("/") or p in ("none", "auto"):
        return p
    return f"{values['model']['mountPath']}/{p}"


def redis_url(values: dict) -> str:
    if values["redis"]["enabled"]:
        r = values["redis"]
        return f"redis://{RELEASE}-redis.{NAMESPACE}.svc:{r['port']}/{r['db']}"  # no password in the URL
    ext = values["externalRedis"]
    scheme, rest = ext["url"].split("://", 1)
    user = ext["username"]
    return f"{scheme}://{user}@{rest}" if user else ext["url"]


def expected_env(values: dict) -> dict[str, dict[str, str | None]]:
    """component -> {variable: the string values.yaml implies, or None where it must be unset}."""
    v = values
    common = {
        "AERIE_HOST": v["config"]["host"],
        "AERIE_DRAIN_S": str(v["config"]["drainSeconds"]),
        "AERIE_LOG_LEVEL": v["config"]["logLevel"],
        "AERIE_METRICS_PORT": str(v["config"]["metricsPort"]),
        "AERIE_MAX_MESSAGE_BYTES": str(v["config"]["maxMessageBytes"]),
        "AERIE_CACHE_DIR": v["config"]["cacheDir"],
        "OTEL_EXPORTER_OTLP_ENDPOINT": v["otel"]["endpoint"] or None,
    }
    download_dir = v["model"]["mountPath"] if v["model"]["source"] == "hub" else None
    model = {
        "AERIE_TARGET": model_path(v, v["model"]["target"]) if v["model"]["target"] else None,
        "AERIE_DTYPE": v["model"]["dtype"],
        "AERIE_DOWNLOAD_DIR": download_dir,
    }
    d, ver, c = v["drafter"], v["verifier"], v["coordinator"]
    registers = str(c["discoverRegistered"]) == "1"

    def registration(port: int) -> dict[str, str | None]:
        return {"AERIE_REDIS_URL": redis_url(v) if registers else None,
                "AERIE_ADVERTISE_ADDRESS": f"$(POD_IP):{port}" if registers else None,
                "AERIE_HEARTBEAT_S": str(v["registration"]["heartbeatSeconds"]) if registers else None,
                "AERIE_HEARTBEAT_TTL_S": str(v["registration"]["heartbeatTtlSeconds"]) if registers else None}

    return {
        "coordinator": common | {
            "AERIE_COORDINATOR_PORT": str(c["port"]),
            "AERIE_REDIS_URL": redis_url(v),
            "AERIE_DRAFTERS": c["drafters"] or (f"{RELEASE}-drafter.{NAMESPACE}.svc:{d['port']}"
                                                if d["enabled"] else ""),
            "AERIE_VERIFIERS": c["verifiers"] or f"{RELEASE}-verifier.{NAMESPACE}.svc:{ver['port']}",
            "AERIE_MAX_NEW_TOKENS": str(c["maxNewTokens"]),
            "AERIE_SEQUENCE_TTL_S": str(c["sequenceTtlSeconds"]),
            "AERIE_MAX_SEQUENCES": str(c["maxSequences"]),
            "AERIE_RPC_TIMEOUT_S": str(c["rpcTimeoutSeconds"]),
            "AERIE_PREFILL_TRIES": str(c["prefillTries"]),
            "AERIE_RESOLVE_INTERVAL_S": str(c["resolveIntervalSeconds"]),
            "AERIE_RETRIEVAL": "1" if c["retrieval"] else "0",
            "AERIE_OVERLAP": str(c["overlap"]),
            "AERIE_PLAIN_RUN": str(c["plainRun"]),
            "AERIE_DIRECT_DRAFTS": "1" if c["directDrafts"] else "0",
            "AERIE_VERIFIER_WAIT_S": str(c["verifierWaitSeconds"]),
            "AERIE_PROBE_INTERVAL_S": str(c["probeIntervalSeconds"]),
            "AERIE_LEASE_TTL_S": str(c["leaseTtlSeconds"]),
            "AERIE_FINISHED_TTL_S": str(c["finishedTtlSeconds"]),
            "AERIE_REDIS_RETRY_S": str(c["redisRetrySeconds"]),
            "AERIE_REDIS_PING_TIMEOUT_S": str(c["redisPingTimeoutSeconds"]),
            "AERIE_DISCOVER": str(c["discoverRegistered"]),
            "AERIE_DISCOVER_INTERVAL_S": str(c["discoverIntervalSeconds"]),
            "AERIE_HTTP_PORT": str(c["httpPort"]),
            "AERIE_HTTP_MAX_BODY_BYTES": str(c["http"]["maxBodyBytes"]),
            "AERIE_HTTP_MAX_HEADER_BYTES": str(c["http"]["maxHeaderBytes"]),
            "AERIE_HTTP_MAX_MESSAGES": str(c["http"]["maxMessages"]),
            "AERIE_HTTP_MAX_CONNECTIONS_PER_PEER": str(c["http"]["maxConnectionsPerPeer"]),
            "AERIE_MAX_SEQUENCES_PER_CLIENT": str(c["maxSequencesPerClient"]),
            "AERIE_TRUSTED_PROXIES": c["trustedProxies"],
            "AERIE_RATE_LIMIT_RPS": str(c["rateLimit"]["rps"]),
            "AERIE_RATE_LIMIT_BURST": str(c["rateLimit"]["burst"]),
            "AERIE_TOKENIZER": model_path(v, c["tokenizer"]) if c["tokenizer"] else None,
            "AERIE_SERVED_MODEL_NAME": c["servedModelName"] or None,
            "AERIE_DOWNLOAD_DIR": download_dir,
        },
        "drafter": common | model | {
            "AERIE_DRAFTER_PORT": str(d["port"]),
            "AERIE_DRAFT": model_path(v, v["model"]["draft"]) if v["model"]["draft"] else None,
            "AERIE_MAX_SEQUENCES": str(d["maxSequences"]),
            "AERIE_TREE_TOP_K": str(d["tree"]["topK"]),
            "AERIE_TREE_DEPTH": str(d["tree"]["depth"]),
            "AERIE_TREE_TOKENS": str(d["tree"]["tokens"]),
            "AERIE_IDLE_TTL_S": str(d["idleTtlSeconds"]),
            "AERIE_DEVICE": "cuda" if d["gpu"] > 0 else "cpu",
        } | registration(d["port"]),
        "verifier": common | model | {
            "AERIE_VERIFIER_PORT": str(ver["port"]),
            "AERIE_MAX_SEQUENCES": str(ver["maxSequences"]),
            "AERIE_MAX_PROMPT_TOKENS": str(ver["maxPromptTokens"]),
            "AERIE_TP_SIZE": str(ver["tpSize"]),
            "AERIE_IDLE_TTL_S": str(ver["idleTtlSeconds"]),
            "AERIE_DEVICE": "cuda" if ver["useGpu"] else "cpu",
            "AERIE_TP_EXECUTOR": ver["executor"],
            "AERIE_TP_TIMEOUT_S": str(ver["tpTimeoutSeconds"]),
        } | registration(ver["port"]),
    }


def pod_specs(r: Render) -> list[tuple[str, dict]]:
    return [(w["metadata"]["name"], w["spec"]["template"]["spec"]) for w in r.workloads()]


# --- pool sizes and GPUs -----------------------------------------------------------------------

def test_pool_sizes_follow_their_own_values(helm, default_render, scale_render):
    assert default_render.component("drafter")["spec"]["replicas"] == 1
    assert default_render.component("verifier")["spec"]["replicas"] == 1
    assert scale_render.component("drafter")["spec"]["replicas"] == 3
    assert scale_render.component("verifier")["spec"]["replicas"] == 2
    # Each pool moves alone.
    r = render(helm, [], ["--set", "drafter.replicas=5", "--set", "verifier.groups=3"])
    assert (r.component("drafter")["spec"]["replicas"], r.component("verifier")["spec"]["replicas"]) == (5, 3)
    r = render(helm, [], ["--set", "drafter.replicas=2"])
    assert (r.component("drafter")["spec"]["replicas"], r.component("verifier")["spec"]["replicas"]) == (2, 1)
    assert r.component("coordinator")["spec"]["replicas"] == 2


def test_drafters_can_be_turned_off_for_plain_decoding(helm):
    r = render(helm, [], ["--set", "drafter.enabled=false"])
    assert [d for d in r.docs if d["metadata"]["name"] == name("drafter")] == []
    assert r.env("coordinator")["AERIE_DRAFTERS"] == ""
    assert r.component("verifier")["spec"]["replicas"] == 1


def test_autoscaled_pools_leave_replicas_to_the_hpa(helm, scale_render):
    coordinator = scale_render.component("coordinator")
    assert "replicas" not in coordinator["spec"]
    hpa = scale_render.get("HorizontalPodAutoscaler", name("coordinator"))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": name("coordinator")}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    r = render(helm, [], ["--set", "drafter.autoscaling.enabled=true",
                          "--api-versions", "external.metrics.k8s.io/v1beta1"])
    assert "replicas" not in r.component("drafter")["spec"]
    assert r.get("HorizontalPodAutoscaler", name("drafter"))["spec"]["scaleTargetRef"]["name"] == name("drafter")


def gpus(container: dict) -> tuple[int | None, int | None]:
    res = container.get("resources", {})
    return res.get("limits", {}).get("nvidia.com/gpu"), res.get("requests", {}).get("nvidia.com/gpu")


def test_verifier_group_gets_tp_size_gpus(rendered):
    tp = rendered.values["verifier"]["tpSize"]
    assert gpus(rendered.container("verifier")) == (tp, tp)
    assert rendered.env("verifier")["AERIE_TP_SIZE"] == str(tp)


def test_gpu_requests_are_configurable(helm, scale_render):
    assert gpus(scale_render.container("verifier")) == (4, 4)
    assert gpus(scale_render.container("drafter")) == (1, 1)
    assert gpus(scale_render.container("coordinator")) == (None, None)
    cpu = render(helm, [], ["--set", "drafter.gpu=0", "--set", "verifier.useGpu=false"])
    assert gpus(cpu.container("drafter")) == (None, None)
    assert gpus(cpu.container("verifier")) == (None, None)
    two = render(helm, [], ["--set", "drafter.gpu=2", "--set", "gpuResourceName=amd.com/gpu"])
    assert two.container("drafter")["resources"]["limits"]["amd.com/gpu"] == 2


def test_verifier_groups_are_a_statefulset_with_shared_memory(scale_render):
    sts = scale_render.component("verifier")
    assert sts["spec"]["serviceName"] == name("verifier")
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    shm = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert shm == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]


def test_gpu_pools_run_on_the_gpu_and_say_it_is_untested(helm, scale_render):
    """The GPU values drive real device use: a pod that requests GPUs gets AERIE_DEVICE=cuda, a CPU pod cpu;
    the notes say cuda is untested on hardware."""
    assert scale_render.env("verifier")["AERIE_DEVICE"] == "cuda" and scale_render.env("drafter")["AERIE_DEVICE"] == "cuda"
    cpu = render(helm, [], ["--set", "drafter.gpu=0", "--set", "verifier.useGpu=false"])
    assert cpu.env("verifier")["AERIE_DEVICE"] == "cpu" and cpu.env("drafter")["AERIE_DEVICE"] == "cpu"
    notes = helm_notes(helm, VALUE_SETS["scale"])
    assert "tensor-parallel size 4 (4 GPU each, one pod)" in notes and "untested on GPU" in notes
    assert "NOT" not in (ROOT / "k8s/charts/aerie/values.yaml").read_text().split("image:")[0]


def test_groups_larger_than_a_node_use_the_ray_executor(helm):
    """executor ray: the ranks are Ray actors in the KubeRay cluster at rayAddress (GPU bundles), so the
    verifier pod requests no GPU; a missing address is a render error."""
    ray = render(helm, [], ["--set", "verifier.tpSize=16", "--set", "verifier.executor=ray",
                            "--set", "verifier.rayAddress=ray://aerie-raycluster-head-svc:10001"])
    env = ray.env("verifier")
    assert (env["AERIE_TP_SIZE"], env["AERIE_TP_EXECUTOR"], env["AERIE_DEVICE"]) == ("16", "ray", "cuda")
    assert env["RAY_ADDRESS"] == "ray://aerie-raycluster-head-svc:10001"
    assert gpus(ray.container("verifier")) == (None, None)
    with pytest.raises(Exception, match="rayAddress"):
        render(helm, [], ["--set", "verifier.executor=ray"])


# --- Redis and its password --------------------------------------------------------------------

def test_redis_statefulset_has_aof_on_a_pvc(default_render):
    sts = default_render.component("redis")
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    mounts = {m["name"]: m["mountPath"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/data"
    conf = default_render.get("ConfigMap", name("redis"))["data"]["redis.conf"]
    assert "appendonly yes" in conf.splitlines() and "dir /data" in conf.splitlines()
    assert "appendfsync everysec" in conf.splitlines()


def test_redis_password_is_never_plain_text(helm, default_render):
    # A chart-generated password: only its base64 form, inside the Secret's data.
    secret = default_render.get("Secret", name("redis"))
    encoded = secret["data"]["redis-password"]
    password = base64.b64decode(encoded).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    assert password not in default_render.text
    assert default_render.text.count(encoded) == 1
    # A password given in values: same.
    plain = "Pl41nTextRedisPassw0rd"
    r = render(helm, [], ["--set", f"redis.auth.password={plain}"])
    assert plain not in r.text
    assert base64.b64decode(r.get("Secret", name("redis"))["data"]["redis-password"]).decode() == plain
    # Consumers get it from the Secret beside a URL without credentials: nothing to URL-encode, so
    # any character is safe (tests/security/test_redis_hardening.py runs such a password for real).
    for rr in (default_render, r):
        env = rr.env("coordinator")
        assert env["AERIE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": name("redis"), "key": "redis-password"}}
        assert "@" not in env["AERIE_REDIS_URL"] and "PASSWORD" not in env["AERIE_REDIS_URL"]
        redis_env = {e["name"]: e for e in rr.container("redis")["env"]}
        assert all("valueFrom" in e for e in redis_env.values())


def test_existing_secret_is_used_and_no_secret_is_rendered(scale_render):
    assert [s for s in scale_render.kind("Secret") if "redis" in s["metadata"]["name"]] == []
    ref = {"secretKeyRef": {"name": "aerie-redis", "key": "password"}}
    assert scale_render.env("coordinator")["AERIE_REDIS_PASSWORD"] == ref
    assert {e["name"]: e.get("valueFrom") for e in scale_render.container("redis")["env"]}["REDIS_PASSWORD"] == ref


def test_external_redis_renders_no_redis(external_render):
    assert [d for d in external_render.docs if d["metadata"]["name"] == name("redis")] == []
    assert all(s["metadata"]["name"] != name("redis") for s in external_render.kind("StatefulSet"))
    assert [s["metadata"]["name"] for s in external_render.kind("StatefulSet")] == [name("verifier")]
    assert [s for s in external_render.kind("Secret") if "redis" in s["metadata"]["name"]] == []
    env = external_render.env("coordinator")
    assert env["AERIE_REDIS_URL"] == "rediss://aerie@redis.example.internal:6380/2"
    assert env["AERIE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "external-redis", "key": "redis-password"}}


def test_external_redis_without_password(helm):
    r = render(helm, [], ["--set", "redis.enabled=false", "--set", "externalRedis.url=redis://redis.db:6379/0"])
    env = r.env("coordinator")
    assert env["AERIE_REDIS_URL"] == "redis://redis.db:6379/0" and "AERIE_REDIS_PASSWORD" not in env


# --- security ----------------------------------------------------------------------------------

def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def assert_restricted(r: Render) -> None:
    for wname, spec in pod_specs(r):
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, wname
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, wname
        assert spec.get("automountServiceAccountToken") is False, wname
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), wname
        for c in all_containers(spec):
            sc = c.get("securityContext", {})
            where = f"{wname}/{c['name']}"
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod.get("runAsUser")) not in (None, 0), where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("privileged", False) is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("seccompProfile", pod.get("seccompProfile")) == {"type": "RuntimeDefault"}, where


def test_every_container_is_restricted(rendered):
    assert_restricted(rendered)


def test_model_init_containers_are_restricted_too(helm):
    r = render(helm, [], ["--set", "model.source=emptyDir", "--set", "model.target=tiny", "--set-json",
                          'model.initContainers=[{"name":"fill","image":"busybox:1.36","command":["true"]}]'])
    for component in ("drafter", "verifier"):
        [init] = r.component(component)["spec"]["template"]["spec"]["initContainers"]
        assert init["volumeMounts"] == [{"name": "models", "mountPath": "/models"}]
    assert_restricted(r)


def test_writable_scratch_dirs_are_empty_dirs(rendered):
    cache = rendered.values["config"]["cacheDir"]
    for component in AERIE:
        spec = rendered.component(component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], component
        assert "emptyDir" in volumes[mounts[cache]], component
        assert rendered.env(component)["AERIE_CACHE_DIR"] == cache


def test_resources_have_requests_and_limits(rendered):
    for wname, spec in pod_specs(rendered):
        for c in spec["containers"]:
            res = c["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{wname}/{c['name']} {kind}"


# --- configuration -----------------------------------------------------------------------------

def test_expected_env_covers_the_contract():
    expected = expected_env(render_values_default())
    for component in AERIE:
        assert CONTRACT["common"] | CONTRACT[component] <= set(expected[component]), component


def render_values_default() -> dict:
    from tests.k8s.chart import merged_values
    return merged_values([])


def test_every_setting_carries_its_value(rendered):
    expected = expected_env(rendered.values)
    for component in AERIE:
        env = rendered.env(component)
        for var, want in expected[component].items():
            if want is None:
                assert var not in env, f"{component}: {var} should be unset, is {env.get(var)!r}"
            else:
                assert env.get(var) == want, f"{component}: {var} = {env.get(var)!r}, values.yaml implies {want!r}"


def test_scale_values_set_every_contract_variable(scale_render):
    """values-scale.yaml sets every setting to a non-default, so nothing above is vacuous."""
    defaults = expected_env(render_values_default())
    scaled = expected_env(scale_render.values)
    for component in AERIE:
        for var in CONTRACT["common"] | CONTRACT[component]:
            assert scaled[component][var] is not None, (component, var)
            # AERIE_DISCOVER: on in both (values-external-redis.yaml turns it off); the scale set keeps GPUs
            # and one-pod groups as the default does (AERIE_DEVICE, AERIE_TP_EXECUTOR: CPU and Ray renders
            # are checked by their own tests)
            if var not in ("AERIE_REDIS_URL", "AERIE_DRAFTERS", "AERIE_VERIFIERS", "AERIE_DISCOVER", "AERIE_DEVICE",
                           "AERIE_TP_EXECUTOR"):
                assert scaled[component][var] != defaults[component][var], (component, var)


def test_models_are_mounted_read_only_and_never_downloaded(scale_render, external_render, default_render):
    for r, volume in ((scale_render, {"persistentVolumeClaim": {"claimName": "aerie-models", "readOnly": True}}),
                      (external_render, {"hostPath": {"path": "/mnt/models", "type": "Directory"}})):
        for component in ("drafter", "verifier"):
            spec = r.component(component)["spec"]["template"]["spec"]
            [vol] = [v for v in spec["volumes"] if v["name"] == "models"]
            assert {k: v for k, v in vol.items() if k != "name"} == volume
            [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models"]
            assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    for component in AERIE:
        assert default_render.env(component)["HF_HUB_OFFLINE"] == "1"
    spec = default_render.component("verifier")["spec"]["template"]["spec"]
    assert all(v["name"] != "models" for v in spec["volumes"])  # model.source=image


def test_services_read_no_setting_the_chart_does_not_know(helm):
    """Every AERIE_* name in the service code is set by the chart (or listed in NOT_SET_BY_CHART)."""
    read: set[str] = set()
    for top in ("services", "coordinator", "drafter_svc", "verifier_svc", "gateway"):
        for f in (ROOT / top).rglob("*.py"):
            if "gen" in f.relative_to(ROOT).parts:
                continue
            read |= set(re.findall(r"\bAERIE_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace")))
    chart_sets: set[str] = set()
    for files in VALUE_SETS.values():
        r = render(helm, files)
        for component in AERIE:
            chart_sets |= set(r.env(component))
    unknown = read - chart_sets - set(NOT_SET_BY_CHART)
    assert not unknown, (f"the services read {sorted(unknown)} but the Helm chart never sets them: map them "
                         "in k8s/charts/aerie (values.yaml + templates/configmap.yaml) or list them in "
                         "NOT_SET_BY_CHART with the reason")


# --- probes and services -----------------------------------------------------------------------

def test_probes_are_grpc_health_checks(rendered, helm):
    """gRPC health probes (the coordinator's startup probe asks its HTTP API instead:
    test_chart_operations.py). With TLS (the default) they ask the plaintext health-only port
    (probes.healthPort -> AERIE_HEALTH_PORT): kubelet gRPC probes cannot speak TLS."""
    plain = render(helm, [], ["--set", "security.tls.enabled=false"])
    for r, tls in ((rendered, rendered.values["security"]["tls"]["enabled"]), (plain, False)):
        for component in AERIE:
            c = r.container(component)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["grpc"] == r.values[component]["port"]
            port = ports["health"] if tls else ports["grpc"]
            if tls:
                assert port == r.values["probes"]["healthPort"]
                assert r.env(component)["AERIE_HEALTH_PORT"] == str(port)
            else:
                assert "health" not in ports and "AERIE_HEALTH_PORT" not in r.env(component)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if (component, probe) == ("coordinator", "startupProbe") or (
                        (component, probe) == ("coordinator", "readinessProbe")
                        and r.values["probes"]["coordinatorReadiness"] == "http"):
                    continue  # GET /metrics, GET /health on the HTTP API (test_chart_operations.py)
                assert set(c[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, (component, probe)
                # readiness asks "": a coordinator is NOT_SERVING while Redis is unreachable or it drains; its
                # liveness asks "liveness", which stays SERVING while Redis is down (a restart cannot help)
                want = {"port": port, "service": "liveness"} \
                    if (component, probe) == ("coordinator", "livenessProbe") else {"port": port}
                assert c[probe]["grpc"] == want, (component, probe)


def test_pools_are_discovered_through_headless_services(rendered):
    for component in ("drafter", "verifier"):
        svc = rendered.get("Service", name(component))
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == rendered.component(component)["spec"]["selector"]["matchLabels"]
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"] == rendered.values[component]["port"]
    coordinator = rendered.get("Service", name("coordinator"))
    assert coordinator["spec"]["type"] == "ClusterIP"


def test_every_pool_has_a_disruption_budget(rendered):
    for component in AERIE:
        pdb = rendered.get("PodDisruptionBudget", name(component))
        assert pdb["spec"]["selector"]["matchLabels"] == \
            rendered.component(component)["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["maxUnavailable"] == 1


def test_termination_grace_covers_draining(rendered):
    for component in AERIE:
        spec = rendered.component(component)["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 30


# --- network policies --------------------------------------------------------------------------

def selects(policy: dict, labels: dict) -> bool:
    sel = policy["spec"]["podSelector"]
    assert not sel.get("matchExpressions")
    return all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())


def pod_labels(r: Render, component: str) -> dict:
    return r.component(component)["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("component", ["drafter", "verifier", "redis"])
def test_only_coordinators_reach_backends(rendered, component):
    if component == "redis" and not rendered.values["redis"]["enabled"]:
        assert rendered.find("NetworkPolicy", name("redis")) is None  # nothing to protect
        return
    labels = pod_labels(rendered, component)
    coordinator = pod_labels(rendered, "coordinator")
    policies = [p for p in rendered.kind("NetworkPolicy") if selects(p, labels)]
    assert policies, f"no NetworkPolicy selects {component} pods"
    admitted = False
    for p in policies:
        assert "Ingress" in p["spec"]["policyTypes"]
        for rule in p["spec"].get("ingress", []):
            ports = {port["port"] for port in rule.get("ports", [])}
            if ports == {"metrics"}:
                continue  # Prometheus scraping, from networkPolicy.metricsFrom only
            assert rule.get("from"), f"{p['metadata']['name']}: a rule without `from` admits everyone"
            for peer in rule["from"]:
                # a bare podSelector: pods of this namespace only, and only coordinator pods (and, for
                # Redis while they register, drafter and verifier pods)
                assert set(peer) == {"podSelector"}, peer
                sel = peer["podSelector"]["matchLabels"]
                registers = component == "redis" and str(rendered.values["coordinator"]["discoverRegistered"]) == "1"
                # (and verifier pods to drafters with direct drafts: test_chart_operations.py)
                direct = component == "drafter" and rendered.values["coordinator"]["directDrafts"]
                allowed = (("coordinator", "drafter", "verifier") if registers else
                           ("coordinator", "verifier") if direct else ("coordinator",))
                assert sel.get("app.kubernetes.io/component") in allowed, sel
                peer_labels = pod_labels(rendered, sel["app.kubernetes.io/component"])
                assert all(peer_labels.get(k) == v for k, v in sel.items())
                assert all(coordinator.get(k) == v for k, v in sel.items() if k != "app.kubernetes.io/component")
                assert pod_labels(rendered, component).get("app.kubernetes.io/component") != "coordinator"
                admitted = True
    assert admitted, f"{component}: nothing may reach it at all"


def test_clients_reach_coordinators(default_render, external_render):
    labels = pod_labels(default_render, "coordinator")
    [policy] = [p for p in default_render.kind("NetworkPolicy") if selects(p, labels)]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "grpc", "protocol": "TCP"}, {"port": "http", "protocol": "TCP"}]
    assert "from" not in rule
    labels = pod_labels(external_render, "coordinator")
    [policy] = [p for p in external_render.kind("NetworkPolicy") if selects(p, labels)]
    rule, gateway = policy["spec"]["ingress"]
    assert rule["from"] == external_render.values["networkPolicy"]["clientsFrom"]
    # the HTTP gateway's pods reach the coordinators' gRPC port whatever clientsFrom admits
    assert gateway["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert gateway["from"] == [{"podSelector": {"matchLabels": {
        k: v for k, v in pod_labels(external_render, "gateway").items()
        if k in external_render.component("gateway")["spec"]["selector"]["matchLabels"]}}}]


def test_metrics_are_opened_only_to_metrics_from(scale_render, default_render):
    for p in default_render.kind("NetworkPolicy"):
        assert all({port["port"] for port in rule["ports"]} != {"metrics"} for rule in p["spec"]["ingress"])
    allowed = scale_render.values["networkPolicy"]["metricsFrom"]
    for component in AERIE:
        labels = pod_labels(scale_render, component)
        [policy] = [p for p in scale_render.kind("NetworkPolicy") if selects(p, labels)]
        metrics = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": "metrics", "protocol": "TCP"}]]
        assert [r["from"] for r in metrics] == [allowed]


# --- registration and the failure model ----------------------------------------------------------

def test_pods_register_with_their_pod_ip(rendered):
    """With registration on (the default), drafter and verifier pods get the Redis URL (the password
    only through the Secret), their pod IP from the downward API and advertise $(POD_IP):port."""
    registers = str(rendered.values["coordinator"]["discoverRegistered"]) == "1"
    for component in ("drafter", "verifier"):
        env = rendered.env(component)
        if not registers:
            assert "AERIE_REDIS_URL" not in env and "POD_IP" not in env and "REDIS_PASSWORD" not in env
            continue
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["AERIE_ADVERTISE_ADDRESS"] == f"$(POD_IP):{rendered.values[component]['port']}"
        names = [e["name"] for e in rendered.container(component)["env"]]
        assert names.index("POD_IP") < names.index("AERIE_ADVERTISE_ADDRESS")  # $(POD_IP) expands only then
        assert env["AERIE_REDIS_URL"] == rendered.env("coordinator")["AERIE_REDIS_URL"]
        if "$(REDIS_PASSWORD)" in env["AERIE_REDIS_URL"]:
            assert env["REDIS_PASSWORD"] == rendered.env("coordinator")["REDIS_PASSWORD"]
            assert names.index("REDIS_PASSWORD") < names.index("AERIE_REDIS_URL")
    assert rendered.env("coordinator")["AERIE_DISCOVER"] == ("1" if registers else "0")


def test_external_redis_values_turn_registration_off(external_render, default_render):
    assert str(default_render.values["coordinator"]["discoverRegistered"]) == "1"
    assert str(external_render.values["coordinator"]["discoverRegistered"]) == "0"


def test_coordinator_grace_covers_the_drain_and_the_hand_over(helm):
    """A draining coordinator waits AERIE_DRAIN_S, then up to one round (min(30, rpc timeout)) before
    it hands the rest over: the chart refuses a termination grace that would SIGKILL it first."""
    ok = render(helm, [], ["--set", "config.drainSeconds=20", "--set", "coordinator.terminationGracePeriodSeconds=51"])
    assert ok.component("coordinator")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 51
    from tests.k8s.chart import run_helm, template_args
    out = run_helm(helm, *template_args([], ["--set", "config.drainSeconds=20", "--set",
                                              "coordinator.terminationGracePeriodSeconds=50"]), check=False)
    assert out.returncode != 0 and "must exceed config.drainSeconds + min(30, coordinator.rpcTimeoutSeconds) (50)" \
        in out.stderr, out.stderr
