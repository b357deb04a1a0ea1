"""Every RPC validates its input and answers with a precise status and message; health is SERVING;
large prompt features stream in chunks under a small message limit; downstream failures reach the
client as UNAVAILABLE / DEADLINE_EXCEEDED naming the service; a failing sequence disturbs no other."""

import asyncio
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.redis_server import free_port
from services.engine.engine import GenerationRequest
from services.rpc import codec
from services.rpc.channel import open_channel
from services.rpc import server as rpc_server
from services.rpc.coordinator_client import RemoteError, RemoteSession
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.sampling import SamplingParams
from tests.pipeline import local_engine, local_run, start_pipeline, wait_until
from verifier_svc.server import create_server as create_verifier

LIMIT = 64 * 1024  # a small message limit, so 300 prompt rows of 64 fp32 features need chunks
INVALID, NOT_FOUND, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                 grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, max_sequences=3, max_prompt_tokens=400, max_message_bytes=LIMIT,
                       max_new_tokens=1000)
    yield p
    p.close()


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return e.value.code(), e.value.details()


def generate_request(prompt=(1, 2, 3), **kw) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(prompt_ids=list(prompt), **kw)


GENERATE = [
    (generate_request(()), INVALID, "prompt is empty: give at least one token"),
    (generate_request((1, 128)), INVALID, "prompt token id 128 at position 1 is outside the vocabulary [0, 128)"),
    (generate_request(max_new_tokens=0), INVALID, "max_new_tokens must be >= 1; got 0"),
    (generate_request(max_new_tokens=1001), INVALID, "max_new_tokens must be <= 1000 on this coordinator; got 1001"),
    (generate_request(max_new_tokens=600), INVALID, "exceeds the model context of 512 tokens"),
    (generate_request(sampling=pb.SamplingParams(temperature=-1)), INVALID, "temperature must be >= 0; got -1.0"),
    (generate_request(sampling=pb.SamplingParams(top_p=1.5)), INVALID, "top_p must be in (0, 1]; got 1.5"),
    (generate_request(sampling=pb.SamplingParams(top_k=-2)), INVALID, "top_k must be >= 0 (0 = off); got -2"),
    (generate_request(stop_token_ids=[999]), INVALID, "stop token id 999 is outside the vocabulary"),
    (generate_request(sequence_id="no spaces"), INVALID, "sequence_id must be 1-128 characters"),
    (generate_request([i % 128 for i in range(401)], max_new_tokens=5), EXHAUSTED, "prompt has 401 tokens; this verifier accepts at most 400"),
]


@pytest.mark.parametrize("request_,code,message", GENERATE, ids=[m[:32] for _, _, m in GENERATE])
def test_generate_bad_input(pipeline, request_, code, message):
    stub = pipeline.coordinator_stub()
    got_code, details = status_of(lambda: stub.Generate(request_, timeout=30))
    assert (got_code, message in details) == (code, True), details
    # a sequence that failed after admission (the verifier's prompt limit) leaves just after its error
    wait_until(lambda: len(pipeline.coordinator.sequences) == 0 and pipeline.verifier.num_sequences == 0)


def test_sequence_lookups(pipeline):
    stub = pipeline.coordinator_stub()
    assert status_of(lambda: stub.GetSequence(cpb.GetSequenceRequest(sequence_id="nope"), timeout=5)) == \
        (NOT_FOUND, "unknown sequence 'nope'")
    assert status_of(lambda: stub.Cancel(cpb.CancelRequest(sequence_id="nope"), timeout=5)) == \
        (NOT_FOUND, "unknown sequence 'nope'")
    assert status_of(lambda: stub.GetSequence(cpb.GetSequenceRequest(sequence_id=""), timeout=5))[0] == INVALID
    list(stub.Generate(generate_request(max_new_tokens=3, sequence_id="dup-1"), timeout=30))
    assert status_of(lambda: stub.Generate(generate_request(sequence_id="dup-1"), timeout=30)) == \
        (grpc.StatusCode.ALREADY_EXISTS, "sequence 'dup-1' already exists")
    assert stub.Cancel(cpb.CancelRequest(sequence_id="dup-1"), timeout=5).status == cpb.SEQUENCE_STATUS_FINISHED


def _tree(n=3):
    parents = torch.tensor([-1] + list(range(n - 1)))
    return pb.DraftTree(tokens=codec.encode_tensor(torch.arange(n)), parents=codec.encode_tensor(parents),
                        paths=codec.encode_tensor(torch.arange(n)[None]), scores=codec.encode_tensor(torch.zeros(n)))


def _prefill(seq_id, prompt=(1, 2, 3), capacity=50, kind=pb.FEATURE_KIND_HIDDEN):
    return vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=list(prompt), capacity=capacity, feature_kind=kind)


def test_verifier_bad_input(pipeline):
    stub = pipeline.verifier_stub()
    verify = lambda seq, **kw: stub.Verify(vpb.VerifyRequest(sequence_id=seq, **kw), timeout=10)  # noqa: E731
    assert status_of(lambda: verify("ghost", round_index=1, tree=_tree())) == \
        (NOT_FOUND, "unknown sequence 'ghost' on this verifier")
    assert status_of(lambda: verify("ghost", round_index=0, tree=_tree())) == \
        (INVALID, "round_index must be >= 1 (0 is the prefill); got 0")
    bad = _tree()
    bad.tokens.data = bad.tokens.data[:-1]
    assert status_of(lambda: verify("ghost", round_index=1, tree=bad)) == \
        (INVALID, "tree.tokens has 23 bytes; dtype int64 and shape [3] need 24")
    bad = _tree()
    bad.tokens.CopyFrom(codec.encode_tensor(torch.zeros(3)))
    assert status_of(lambda: verify("ghost", round_index=1, tree=bad)) == (INVALID, "tree.tokens must be int64; got float32")
    assert status_of(lambda: stub.Decode(vpb.DecodeRequest(sequence_id="ghost", round_index=1, token=500), timeout=5)) \
        == (INVALID, "decode token id 500 at position 0 is outside the vocabulary [0, 128)")
    assert status_of(lambda: stub.Prefill(_prefill("p", kind=pb.FEATURE_KIND_UNSPECIFIED), timeout=10)) == \
        (INVALID, "feature_kind must be HIDDEN, TAPS or NONE; got 0")
    assert status_of(lambda: stub.Prefill(_prefill("p", capacity=2), timeout=10)) == \
        (INVALID, f"capacity must be in [4, {512 + 512}] for a 3-token prompt "
                  "(this verifier's limit, AERIE_MAX_SEQUENCE_ROWS); got 2")
    # a message over the server's configured size is refused by gRPC itself
    huge = _tree()
    huge.scores.data = b"\0" * (LIMIT + 1)
    with open_channel(pipeline.addresses["verifier"], 1 << 22) as ch:
        code, details = status_of(lambda: verifier_grpc.VerifierStub(ch).Verify(
            vpb.VerifyRequest(sequence_id="ghost", round_index=1, tree=huge), timeout=10))
    assert code == EXHAUSTED and "Received message larger than max" in details
    # capacity: 3 sequences, then RESOURCE_EXHAUSTED; a duplicate id is INVALID_ARGUMENT
    for i in range(3):
        list(stub.Prefill(_prefill(f"cap-{i}"), timeout=10))
    assert status_of(lambda: stub.Prefill(_prefill("cap-0"), timeout=10)) == \
        (INVALID, "sequence 'cap-0' already exists on this verifier")
    assert status_of(lambda: stub.Prefill(_prefill("cap-3"), timeout=10)) == \
        (EXHAUSTED, "verifier holds its maximum of 3 sequences (AERIE_MAX_SEQUENCES)")
    for i in range(3):
        assert stub.Release(pb.ReleaseRequest(sequence_id=f"cap-{i}"), timeout=5).released
    assert not stub.Release(pb.ReleaseRequest(sequence_id="cap-0"), timeout=5).released  # idempotent


def test_drafter_bad_input(pipeline):
    stub = pipeline.drafter_stub()
    f = torch.zeros(2, 64)

    def draft(features, seq="ghost", tokens=(1, 2)):
        return stub.Draft(dpb.DraftRequest(sequence_id=seq, round_index=2, tokens=list(tokens),
                                           features=codec.encode_tensor(features)), timeout=10)

    assert status_of(lambda: draft(f)) == (NOT_FOUND, "unknown sequence 'ghost' on this drafter")
    assert status_of(lambda: draft(f.bfloat16())) == (INVALID, "features must be float32; got bfloat16")
    assert status_of(lambda: draft(torch.zeros(2, 32))) == (INVALID, "features must have shape [2, 64]; got [2, 32]")
    assert status_of(lambda: draft(f, tokens=(1, -5))) == \
        (INVALID, "draft token id -5 at position 1 is outside the vocabulary [0, 128)")

    def prefill(messages):
        return stub.Prefill(iter(messages), timeout=10)

    head = dpb.DrafterPrefillRequest(sequence_id="d1", max_rows=40, tokens=[1, 2], features=codec.encode_tensor(f))
    assert status_of(lambda: prefill([head, dpb.DrafterPrefillRequest(sequence_id="d1")])) == \
        (INVALID, "only the first Prefill message may carry sequence_id, max_rows and tokens")
    assert status_of(lambda: prefill([head, dpb.DrafterPrefillRequest(features=pb.Tensor(data=b"\0" * 8))])) == \
        (INVALID, "features: chunks add up to more than the 512 bytes its dtype and shape need")
    short = dpb.DrafterPrefillRequest(sequence_id="d1", max_rows=1, tokens=[1, 2], features=codec.encode_tensor(f))
    assert status_of(lambda: prefill([short])) == (INVALID, f"max_rows must be in [2, {512 + 512}] (this drafter's limit: the target's context + "
                  "AERIE_MAX_TREE_NODES); got 1")
    assert status_of(lambda: prefill([])) == (INVALID, "the Prefill stream carried no message")
    for i in range(3):
        prefill([dpb.DrafterPrefillRequest(sequence_id=f"d{i}", max_rows=40, tokens=[1, 2],
                                           features=codec.encode_tensor(f))])
    assert pipeline.drafter.drafter.num_sequences == 3
    over = dpb.DrafterPrefillRequest(sequence_id="d9", max_rows=40, tokens=[1, 2], features=codec.encode_tensor(f))
    assert status_of(lambda: prefill([over])) == (EXHAUSTED, "drafter holds its maximum of 3 sequences")
    for i in range(3):
        stub.Release(pb.ReleaseRequest(sequence_id=f"d{i}"), timeout=5)
    assert pipeline.drafter.drafter.num_sequences == 0


def test_health_is_serving(pipeline):
    for role, name in (("verifier", "aerie.v1.Verifier"), ("drafter", "aerie.v1.Drafter"),
                       ("coordinator", "aerie.v1.Coordinator")):
        stub = health_pb2_grpc.HealthStub(pipeline.channel(role))
        for service in ("", name):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING


def test_long_prompt_features_stream_in_chunks(pipeline, model_dirs):
    """300 rows x 64 fp32 features = 76.8 kB > the 64 KiB message limit, both ways."""
    prompt = tuple(int(x) for x in torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(3)))
    req = GenerationRequest(prompt, 12, SamplingParams(0.8, 1.0, 0, 2))
    session = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=60)
    tokens = [t for s in session.engine.generate(req) for t in s.tokens]
    session.close()
    assert tokens == local_run(local_engine(model_dirs), req)[0]


class SlowDecodeVerifier:
    """The pipeline's real verifier behind a second server whose Decode and DecodeRun never answer (a
    verifier stuck in a long forward): every other RPC is the real one."""

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def Decode(self, request, context):
        await asyncio.sleep(60)  # cancelled when the caller's deadline passes

    async def DecodeRun(self, request, context):
        await asyncio.sleep(60)  # cancelled when the caller's per-step deadline passes
        yield None


def test_unreachable_verifier_is_unavailable(pipeline, redis_url):
    _, dead = pipeline.add_coordinator(redis_url, verifiers=(f"127.0.0.1:{free_port()}",), verifier_wait_s=0.3)
    session = RemoteSession(dead, None, "", timeout_s=30)
    with pytest.raises(RemoteError) as e:
        list(session.engine.generate(GenerationRequest((1, 2), 5)))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(e.value).startswith("no verifier available: verifier at 127.0.0.1:") and "is unavailable" in str(e.value)
    session.close()


def test_verifier_past_its_deadline_fails_over_then_unavailable(pipeline, redis_url):
    """A verifier that misses its deadline leaves placement; with no other verifier answering within
    AERIE_VERIFIER_WAIT_S the sequence fails UNAVAILABLE, naming the missed deadline."""
    config = pipeline.verifier.config
    server, port = pipeline.loop.run(create_verifier("127.0.0.1:0", config, SlowDecodeVerifier(pipeline.verifier)))
    try:
        # plain decoding (no drafter), so the only call that can run out of time is the verifier's Decode
        slow, address = pipeline.add_coordinator(redis_url, verifiers=(f"127.0.0.1:{port}",), drafters=(),
                                                 rpc_timeout_s=1.0, verifier_wait_s=0.3, discover=False)
        session = RemoteSession(address, None, "", timeout_s=30)
        with pytest.raises(RemoteError) as e:
            list(session.engine.generate(GenerationRequest((1, 2), 5), seq_id="slow-1"))
        session.close()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert str(e.value).startswith("sequence 'slow-1' lost its verifier (verifier at "
                                       f"127.0.0.1:{port} did not answer in time"), str(e.value)
        assert "no verifier available" in str(e.value)
        # the client tried one Resume (the UNAVAILABLE might have been its coordinator's), which said
        # the sequence failed: the stream's own error is what it raised
        assert session.resume_tries == 1 and session.resumes == 0
        state = slow.store.get("slow-1")
        assert (state.status, state.finish_reason) == ("failed", "error") and "did not answer in time" in state.error
        assert state.tokens and state.round_index == 0  # the prefill's token committed, no round after it
        wait_until(lambda: pipeline.verifier.num_sequences == 0)  # the release got a deadline of its own
    finally:
        pipeline.loop.run(rpc_server.drain(server, 0.5))


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_a_failing_sequence_does_not_disturb_others(pipeline, model_dirs):
    req = GenerationRequest((8, 6, 4), 80, SamplingParams(0.7, 0.9, 0, 21))
    result = {}

    def good():
        s = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=60)
        result["tokens"] = [t for step in s.engine.generate(req) for t in step.tokens]
        s.close()

    thread = threading.Thread(target=good)
    thread.start()
    stub = pipeline.coordinator_stub()
    for request_, code, _ in GENERATE * 2:
        assert status_of(lambda: stub.Generate(request_, timeout=30))[0] == code
    thread.join(60)
    assert result["tokens"] == local_run(local_engine(model_dirs), req)[0]


def test_a_call_cancelled_by_a_stopping_peer_fails_over() -> None:
    """A replica whose server stops with a call in flight ends that call CANCELLED (the caller never
    cancels its downstream calls): to the coordinator that is UNAVAILABLE, a fail-over, like a
    refused connection; the message names the replica."""
    from coordinator.sequence_placement import is_failover
    from services.rpc.errors import DownstreamError

    class Cancelled(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.CANCELLED

        def details(self):
            return "CANCELLED"

    e = DownstreamError.from_rpc(Cancelled(), "verifier", "127.0.0.1:1")
    assert e.code == grpc.StatusCode.UNAVAILABLE and is_failover(e)
    assert "verifier at 127.0.0.1:1" in str(e) and "cancelled" in str(e)
