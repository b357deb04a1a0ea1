"""Trust boundaries (issue 15, item 4) with real servers on loopback, TLS certificates generated here:

- TLS end to end (client -> coordinator -> drafter/verifier): output equals the in-process engine's;
- a plaintext client is refused by a TLS server;
- the public API needs an API token: none or a wrong one -> UNAUTHENTICATED (gRPC) / 401 (HTTP);
- drafters and verifiers accept only coordinators: a client certificate of the internal CA (mTLS) and
  the internal token, both checked; health needs neither token;
- a sequence is readable, cancellable and resumable only by the identity that created it: another
  identity gets NOT_FOUND, exactly as for an id that does not exist (it learns nothing, not even that
  the id is in use);
- no filesystem path leaves the coordinator (GetInfo, the first stream message, /v1/models, errors).
"""

import json
import ssl

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.server import with_gateway_token
from gateway.server import start_http
from services.engine.engine import GenerationRequest
from services.rpc.channel import open_channel
from services.rpc.security import Security
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc, verifier_grpc
from tests.pipeline import HOST, local_engine, local_run, start_pipeline
from tests.security.certs import make_pki

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789abc"}
INTERNAL = "internal-token-0123456789abcdef"
MB = 4 * 1024 * 1024
UNAUTH, NOT_FOUND, UNAVAILABLE = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.UNAVAILABLE)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured(model_dirs, redis_url, pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("secrets")
    (d / "internal").write_text(INTERNAL + "\n")
    (d / "tokens").write_text("# identity token\n" + "\n".join(f"{i} {t}" for i, t in TOKENS.items()) + "\n")
    p = start_pipeline(model_dirs, redis_url, service_overrides=dict(
        tls_cert=str(pki.leaf.cert), tls_key=str(pki.leaf.key), tls_ca=str(pki.ca.cert),
        internal_token_file=str(d / "internal"), api_tokens_file=str(d / "tokens")))
    yield p
    p.close()


def client(address: str, pki, token: str | None = None, cert=None) -> grpc.Channel:
    """A TLS channel that trusts the test CA, with a bearer token and (for mTLS) a client certificate."""
    security = Security(cert=cert.cert.read_bytes() if cert else None, key=cert.key.read_bytes() if cert else None,
                        ca=pki.ca.cert.read_bytes(), client_token=token)
    return open_channel(address, MB, security)


def coordinator(secured, pki, who: str | None = "alice"):
    return coordinator_grpc.CoordinatorStub(client(secured.addresses["coordinator"], pki, TOKENS.get(who, who)))


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return e.value.code(), e.value.details() or ""


def test_tls_end_to_end_equals_the_in_process_engine(secured, pki, model_dirs):
    prompt = [5, 17, 99, 3, 42]
    want, reason, _ = local_run(local_engine(model_dirs), GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=12))
    got = list(coordinator(secured, pki).Generate(cpb.GenerateRequest(prompt_ids=prompt, max_new_tokens=12), timeout=120))
    assert [t for m in got for t in m.tokens] == want and got[-1].finish_reason == reason


def test_plaintext_client_is_refused_by_a_tls_server(secured):
    for role in ("coordinator", "verifier", "drafter"):
        # a subchannel pool of its own: this process's TLS connections must not be shared with it
        with grpc.insecure_channel(secured.addresses[role], options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == UNAVAILABLE, role


def test_public_api_needs_a_valid_token(secured, pki):
    request = cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=4)
    for who, message in ((None, "/aerie.v1.Coordinator/Generate needs an API token: send 'authorization: "
                                "Bearer <token>'"),
                         ("not-a-known-token-000000", "/aerie.v1.Coordinator/Generate: the bearer token is not "
                                                      "valid here"),
                         (INTERNAL, "/aerie.v1.Coordinator/Generate: the bearer token is not valid here")):
        assert code_of(lambda: coordinator(secured, pki, who).Generate(request, timeout=30)) == (UNAUTH, message)
    assert code_of(lambda: coordinator(secured, pki, None).GetInfo(pb.InfoRequest(), timeout=30))[0] == UNAUTH
    # health answers without a token (probes carry none; it says SERVING and nothing else)
    with client(secured.addresses["coordinator"], pki) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_drafters_and_verifiers_accept_only_coordinators(secured, pki):
    address = secured.addresses["verifier"]

    def info(ch):
        return verifier_grpc.VerifierStub(ch).GetInfo(pb.InfoRequest(), timeout=10)

    # no client certificate, or one from another CA: the TLS handshake fails (mTLS)
    assert code_of(lambda: info(client(address, pki, INTERNAL)))[0] == UNAVAILABLE
    assert code_of(lambda: info(client(address, pki, INTERNAL, cert=pki.rogue_leaf)))[0] == UNAVAILABLE
    # the right certificate but no internal token, or a public API token: UNAUTHENTICATED
    assert code_of(lambda: info(client(address, pki, None, cert=pki.leaf))) == \
        (UNAUTH, "/aerie.v1.Verifier/GetInfo needs the internal token (AERIE_INTERNAL_TOKEN): send "
                 "'authorization: Bearer <token>'")
    assert code_of(lambda: info(client(address, pki, TOKENS["alice"], cert=pki.leaf)))[0] == UNAUTH
    # a coordinator's credentials: certificate + internal token
    assert info(client(address, pki, INTERNAL, cert=pki.leaf)).vocab_size == 128


def test_a_sequence_belongs_to_the_identity_that_created_it(secured, pki, redis_url):
    alice, bob = coordinator(secured, pki, "alice"), coordinator(secured, pki, "bob")
    first = next(iter(alice.Generate(cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=6), timeout=60)))
    seq_id = first.sequence_id
    record = redis.Redis.from_url(redis_url, decode_responses=True).hget(f"aerie:seq:{{{seq_id}}}", "client")
    assert record == "alice"
    unknown = (NOT_FOUND, f"unknown sequence {seq_id!r}")
    assert code_of(lambda: bob.GetSequence(cpb.GetSequenceRequest(sequence_id=seq_id), timeout=10)) == unknown
    assert code_of(lambda: bob.Cancel(cpb.CancelRequest(sequence_id=seq_id), timeout=10)) == unknown
    assert code_of(lambda: bob.Resume(cpb.ResumeRequest(sequence_id=seq_id), timeout=10)) == unknown
    # the same answer as for an id nobody created
    assert code_of(lambda: bob.GetSequence(cpb.GetSequenceRequest(sequence_id="nobody"), timeout=10)) == \
        (NOT_FOUND, "unknown sequence 'nobody'")
    seq = alice.GetSequence(cpb.GetSequenceRequest(sequence_id=seq_id), timeout=10)
    assert list(seq.prompt_ids) == [1, 2, 3]
    assert [m.finish_reason for m in alice.Resume(cpb.ResumeRequest(sequence_id=seq_id), timeout=60)][-1]


def test_no_filesystem_path_leaves_the_coordinator(secured, pki, model_dirs):
    root = str(model_dirs.target.parent)
    alice = coordinator(secured, pki)
    info = alice.GetInfo(pb.InfoRequest(), timeout=30)
    first = next(iter(alice.Generate(cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2), timeout=60)))
    # the tiny target has no tokenizer: the refusal names the tokenizer's source, by name only
    code, refusal = code_of(lambda: alice.Generate(cpb.GenerateRequest(prompt="hello", max_new_tokens=2), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'target'" in refusal
    for text in (str(info), str(first.info), refusal):
        assert root not in text and "/tmp/" not in text, text
    assert info.target == "target" and first.info.target == "target" and first.info.draft == "head"


def test_http_gateway_needs_a_valid_token_over_https(secured, pki):
    c = secured.coordinator
    http = secured.loop.run(start_http(secured.addresses["coordinator"], HOST, 0, secured.service.max_message_bytes,
                                       c.security, with_gateway_token(c), (str(pki.leaf.cert), str(pki.leaf.key))))
    try:
        base = f"https://localhost:{http.port}"
        body = {"model": "target", "prompt": [1, 2, 3], "max_tokens": 3}
        with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca.cert)), timeout=60) as h:
            for headers in ({}, {"Authorization": "Bearer wrong-token-0000000000"}):
                r = h.post(f"{base}/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                assert h.get(f"{base}/v1/models", headers=headers).status_code == 401
            assert h.get(f"{base}/health").status_code == 200  # probes carry no token
            assert h.get(f"{base}/metrics").status_code == 200  # nor does the chart's startup probe
            ok = h.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {TOKENS['bob']}"})
            assert ok.status_code == 200, ok.text
            models = h.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {TOKENS['bob']}"}).json()
            assert "/" not in json.dumps(models["data"][0]["root"])
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port
            httpx.get(f"http://localhost:{http.port}/health", timeout=10)
    finally:
        secured.loop.run(http.stop())


def test_api_tokens_rotate_without_a_restart(secured, pki):
    """The coordinator reads AERIE_API_TOKENS_FILE again when it changes (services/rpc/api_tokens.py):
    alice's new token works at once, her old one and bob's (removed) are refused, and alice still owns
    the sequence she created before (ownership is by identity). The file is restored afterwards."""
    import os
    from pathlib import Path

    path = Path(secured.service.api_tokens_file)
    original = path.read_text()
    alice = coordinator(secured, pki, "alice")
    seq_id = next(iter(alice.Generate(cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2),
                                      timeout=60))).sequence_id
    rotated = "alice-token-rotated-0123456789"
    try:
        (path.parent / "tokens.new").write_text(f"alice {rotated}\n")
        os.replace(path.parent / "tokens.new", path)  # a new inode, as a Kubernetes Secret update
        request = pb.InfoRequest()
        for who in ("alice", "bob"):
            assert code_of(lambda: coordinator(secured, pki, who).GetInfo(request, timeout=30)) == \
                (UNAUTH, "/aerie.v1.Coordinator/GetInfo: the bearer token is not valid here")
        renewed = coordinator(secured, pki, rotated)
        assert renewed.GetSequence(cpb.GetSequenceRequest(sequence_id=seq_id), timeout=10).sequence_id == seq_id
    finally:
        (path.parent / "tokens.new").write_text(original)
        os.replace(path.parent / "tokens.new", path)
    assert coordinator(secured, pki, "bob").GetInfo(pb.InfoRequest(), timeout=30).vocab_size == 128
