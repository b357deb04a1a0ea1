"""The HTTP gateway in the chart (templates/gateway.yaml): `aerie gateway` pods in front of the
coordinator Service, so an HTTP stream outlives its coordinator pod. Checked on rendered manifests:
its settings carry their values, it reads nothing the chart does not set, its probes ask its HTTP API,
it holds the API tokens and its own token but no internal token or Redis URL, and gateway.enabled=false
leaves the coordinators' own HTTP API as the entry point."""

from __future__ import annotations

import re

from tests.k8s.chart import NAMESPACE, ROOT, name, render


def test_the_gateway_points_at_the_coordinator_service(default_render, scale_render):
    for r in (default_render, scale_render):
        v = r.values
        env = r.env("gateway")
        c = v["coordinator"]
        assert r.container("gateway")["args"] == ["gateway"]
        assert env["AERIE_COORDINATORS"] == (v["gateway"]["coordinators"]
                                             or f"{name('coordinator')}.{NAMESPACE}.svc:{c['port']}")
        assert env["AERIE_HTTP_PORT"] == str(v["gateway"]["httpPort"])
        assert env["AERIE_RESUME_S"] == str(v["gateway"]["resumeSeconds"])
        assert env["AERIE_MAX_MESSAGE_BYTES"] == str(v["config"]["maxMessageBytes"])
        for var, key in (("AERIE_HTTP_MAX_BODY_BYTES", "maxBodyBytes"), ("AERIE_HTTP_MAX_HEADER_BYTES", "maxHeaderBytes"),
                         ("AERIE_HTTP_MAX_MESSAGES", "maxMessages"),
                         ("AERIE_HTTP_MAX_CONNECTIONS_PER_PEER", "maxConnectionsPerPeer")):
            assert env[var] == str(c["http"][key]) == r.env("coordinator")[var]  # the same limits as the coordinators'
        ports = {p["name"]: p["containerPort"] for p in r.container("gateway")["ports"]}
        assert ports == {"http": v["gateway"]["httpPort"]}
        service = r.get("Service", name("gateway"))
        assert service["spec"]["ports"] == [{"name": "http", "port": v["gateway"]["httpPort"], "targetPort": "http",
                                             "protocol": "TCP"}]
        assert service["spec"]["selector"] == r.component("gateway")["spec"]["selector"]["matchLabels"]
        assert r.component("gateway")["spec"]["replicas"] == v["gateway"]["replicas"]
        assert r.get("PodDisruptionBudget", name("gateway"))["spec"]["maxUnavailable"] == 1


def test_the_gateway_reads_only_settings_the_chart_sets(default_render):
    """Every AERIE_* name `aerie gateway` reads (aerie_cli/gateway.py, gateway/) is in its pod's env or
    is the client-side one of tests/k8s/test_chart_promises.py's list; the pod carries nothing else."""
    read: set[str] = set()
    for f in [ROOT / "aerie_cli" / "gateway.py", *(ROOT / "gateway").rglob("*.py")]:
        read |= set(re.findall(r"\bAERIE_[A-Z0-9_]*[A-Z0-9]\b", f.read_text()))
    env = {k for k in default_render.env("gateway") if k.startswith("AERIE_")}
    assert env <= read, env - read
    # named in a docstring only: the coordinators' cap, which the gateway learns from GetInfo
    assert read - env == {"AERIE_MAX_NEW_TOKENS"}, read - env


def test_the_gateway_probes_ask_its_http_api(default_render, helm):
    plain = render(helm, [], ["--set", "security.tls.enabled=false"])
    for r, scheme in ((default_render, "HTTPS"), (plain, "HTTP")):
        c = r.container("gateway")
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
        assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http", "scheme": scheme}
        assert "startupProbe" not in c  # nothing to load


def test_the_gateway_holds_the_api_tokens_and_its_own_but_no_backend_secret(default_render, helm):
    env = default_render.env("gateway")
    assert env["AERIE_API_TOKENS_FILE"] == "/etc/aerie/api/tokens"
    assert env["AERIE_API_TOKEN"] == {"secretKeyRef": {"name": name("api-tokens"), "key": "gateway"}}
    assert env["AERIE_TLS_CERT"] == "/etc/aerie/tls/tls.crt" and env["AERIE_TLS_SERVER_NAME"] == "aerie-internal"
    assert not {"AERIE_INTERNAL_TOKEN", "AERIE_REDIS_URL", "AERIE_REDIS_PASSWORD", "AERIE_HEALTH_PORT"} & set(env)
    mounts = {m["name"]: m for m in default_render.container("gateway")["volumeMounts"]}
    assert mounts["api-tokens"]["readOnly"] is True and mounts["tls"]["readOnly"] is True
    off = render(helm, [], ["--set", "security.tls.enabled=false", "--set", "security.apiTokens.enabled=false"])
    assert not {"AERIE_TLS_CERT", "AERIE_API_TOKENS_FILE", "AERIE_API_TOKEN"} & set(off.env("gateway"))


def test_the_gateway_takes_http_clients_and_reaches_coordinators(external_render):
    """With networkPolicy.clientsFrom: the gateway admits HTTP from those clients only."""
    labels = external_render.component("gateway")["spec"]["template"]["metadata"]["labels"]
    [policy] = [p for p in external_render.kind("NetworkPolicy")
                if all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert rule["from"] == external_render.values["networkPolicy"]["clientsFrom"]


def test_gateway_disabled_renders_none(helm):
    r = render(helm, [], ["--set", "gateway.enabled=false"])
    assert not [d for d in r.docs if d["metadata"]["name"] == name("gateway")]
    assert r.env("coordinator")["AERIE_HTTP_PORT"] == "8000"  # the coordinators' own API stays
