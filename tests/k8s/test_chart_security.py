"""The chart turns the trust boundaries on by default (issue 15; docs/security.md), offline with
`helm template`: TLS with a generated CA whose certificate names every Service, the internal token
on every aerie pod, API tokens on the coordinator, Redis with maxmemory/noeviction and no CONFIG, and
the coordinator's HTTP API exposed (container and Service port, AERIE_HTTP_PORT, AERIE_TOKENIZER)."""

import base64

from cryptography import x509

from tests.k8s.chart import NAMESPACE, name, render

AERIE = ("coordinator", "drafter", "verifier")


def test_tls_and_tokens_are_on_by_default(default_render):
    secret = default_render.get("Secret", name("tls"))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert cert.issuer == ca.subject
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    for component in AERIE:
        assert f"{name(component)}.{NAMESPACE}.svc" in sans
    assert "aerie-internal" in sans and "localhost" in sans
    for component in AERIE:
        env = default_render.env(component)
        assert env["AERIE_TLS_CERT"] == "/etc/aerie/tls/tls.crt" and env["AERIE_TLS_CA"] == "/etc/aerie/tls/ca.crt"
        assert env["AERIE_TLS_SERVER_NAME"] == "aerie-internal"
        assert env["AERIE_INTERNAL_TOKEN"] == {"secretKeyRef": {"name": name("internal-token"), "key": "token"}}
        mounts = {m["name"]: m for m in default_render.container(component)["volumeMounts"]}
        assert mounts["tls"]["readOnly"] is True
    assert default_render.env("coordinator")["AERIE_API_TOKENS_FILE"] == "/etc/aerie/api/tokens"
    assert "AERIE_API_TOKENS_FILE" not in default_render.env("verifier")
    tokens = base64.b64decode(default_render.get("Secret", name("api-tokens"))["data"]["tokens"]).decode()
    (identity, token), (gateway, own) = (line.split() for line in tokens.splitlines())
    assert identity == "default" and len(token) == 40
    assert gateway == "gateway" and len(own) == 40 and own != token  # the HTTP gateway's own calls
    assert base64.b64decode(default_render.get("Secret", name("api-tokens"))["data"]["gateway"]).decode() == own
    assert token not in default_render.text and own not in default_render.text  # only base64, inside the Secret


def test_security_can_be_turned_off_for_a_trusted_network(helm):
    r = render(helm, [], ["--set", "security.tls.enabled=false", "--set", "security.internalToken.enabled=false",
                          "--set", "security.apiTokens.enabled=false"])
    assert r.find("Secret", name("tls")) is None and r.find("Secret", name("api-tokens")) is None
    for component in AERIE:
        assert not {"AERIE_TLS_CERT", "AERIE_INTERNAL_TOKEN", "AERIE_API_TOKENS_FILE"} & set(r.env(component))


def test_existing_secrets_are_used(helm):
    r = render(helm, [], ["--set", "security.tls.existingSecret=my-tls", "--set",
                          "security.internalToken.existingSecret=my-internal", "--set",
                          "security.apiTokens.existingSecret=my-api"])
    assert [s["metadata"]["name"] for s in r.kind("Secret")] == [name("redis")]
    spec = r.component("coordinator")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "my-tls"
    assert volumes["api-tokens"]["secret"]["secretName"] == "my-api"
    assert r.env("drafter")["AERIE_INTERNAL_TOKEN"]["secretKeyRef"]["name"] == "my-internal"


def test_redis_has_maxmemory_noeviction_and_no_config(default_render):
    conf = default_render.get("ConfigMap", name("redis"))["data"]["redis.conf"].splitlines()
    assert "maxmemory 1gb" in conf and "maxmemory-policy noeviction" in conf
    assert 'rename-command CONFIG ""' in conf


def test_coordinator_serves_the_http_api(default_render, scale_render):
    for r, port in ((default_render, 8000), (scale_render, 8081)):
        assert r.env("coordinator")["AERIE_HTTP_PORT"] == str(port)
        ports = {p["name"]: p["containerPort"] for p in r.container("coordinator")["ports"]}
        assert ports["http"] == port
        service = r.get("Service", name("coordinator"))
        assert {"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"} in service["spec"]["ports"]
    # a tokenizer on the model volume: the coordinator mounts it read-only and names the file
    assert scale_render.env("coordinator")["AERIE_TOKENIZER"] == "/models/smollm2/model.gguf"
    mounts = {m["name"]: m for m in scale_render.container("coordinator")["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    assert "AERIE_TOKENIZER" not in default_render.env("coordinator")  # image: the verifiers' target
