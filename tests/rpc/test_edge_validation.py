"""Validation at every gRPC edge (issue 15, item 3): bytes that are no valid message get
INVALID_ARGUMENT naming the method (not UNKNOWN "Unexpected DecodeError"); non-finite features never
reach a draft KV; a tree verified on a sequence prefilled without features works instead of failing
after its KV was compacted."""

import grpc
import pytest
import torch

from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.spec.sampling import SamplingParams
from tests.pipeline import start_pipeline

GARBAGE = b"\xff\xff\xff\xff\x0f"  # a truncated varint: no message type decodes it
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    yield p
    p.close()


@pytest.mark.parametrize("role, method, kind", [
    ("coordinator", "/aerie.v1.Coordinator/Generate", "unary_stream"),
    ("coordinator", "/aerie.v1.Coordinator/Cancel", "unary_unary"),
    ("verifier", "/aerie.v1.Verifier/Verify", "unary_unary"),
    ("verifier", "/aerie.v1.Verifier/Prefill", "unary_stream"),
    ("drafter", "/aerie.v1.Drafter/Prefill", "stream_unary"),
])
def test_undecodable_bytes_are_invalid_argument(pipeline, role, method, kind):
    channel = pipeline.channel(role)
    raw = dict(request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        if kind == "unary_unary":
            channel.unary_unary(method, **raw)(GARBAGE, timeout=10)
        elif kind == "unary_stream":
            list(channel.unary_stream(method, **raw)(GARBAGE, timeout=10))
        else:
            channel.stream_unary(method, **raw)(iter([GARBAGE]), timeout=10)
    assert e.value.code() == INVALID, e.value.details()
    assert e.value.details().startswith(f"the request to {method} is not a valid message")


def _prefill_drafter(pipeline, seq_id: str, n: int, features: torch.Tensor):
    head = pipeline.drafter.drafter.head.config
    first = dpb.DrafterPrefillRequest(sequence_id=seq_id, tokens=list(range(1, n + 1)), max_rows=64,
                                      features=next(codec.tensor_chunks(features, 1 << 20)))
    assert features.shape == (n, head.feature_size)
    return pipeline.drafter_stub().Prefill(iter([first]), timeout=30)


def test_non_finite_features_never_reach_the_draft_kv(pipeline):
    f = pipeline.drafter.drafter.head.config.feature_size
    good = torch.randn(4, f, generator=torch.Generator().manual_seed(0))
    for bad_value in (float("nan"), float("inf")):
        bad = good.clone()
        bad[2, 5] = bad_value
        with pytest.raises(grpc.RpcError) as e:
            _prefill_drafter(pipeline, "poison", 4, bad)
        assert e.value.code() == INVALID
        assert e.value.details() == "features holds 1 non-finite value(s) (NaN or inf)"
    assert "poison" not in pipeline.drafter.drafter._caches  # nothing was allocated
    tree = codec.decode_tree(_prefill_drafter(pipeline, "clean", 4, good).tree, 128)
    assert torch.isfinite(tree.scores).all()
    # a later round with poisoned features is refused and leaves the sequence's KV as it was
    rows = pipeline.drafter.drafter._caches["clean"].length
    bad = torch.full((2, f), float("nan"))
    with pytest.raises(grpc.RpcError) as e:
        pipeline.drafter_stub().Draft(dpb.DraftRequest(sequence_id="clean", round_index=2, tokens=[3, 4],
                                                       features=next(codec.tensor_chunks(bad, 1 << 20))), timeout=30)
    assert e.value.code() == INVALID and "non-finite" in e.value.details()
    assert pipeline.drafter.drafter._caches["clean"].length == rows
    pipeline.drafter_stub().Release(pb.ReleaseRequest(sequence_id="clean"), timeout=10)


def test_verify_on_a_sequence_without_features(pipeline):
    """Prefill with FEATURE_KIND_NONE (plain decoding, or retrieval drafts that need no head), then
    Verify a tree: the same acceptance as a feature-carrying sequence, with no features returned."""
    stub = pipeline.verifier_stub()
    prompt = [5, 9, 17, 3]
    results = {}
    for seq_id, kind in (("with-none", codec.WIRE_FEATURE_KINDS["none"]),
                         ("with-hidden", codec.WIRE_FEATURE_KINDS["hidden"])):
        first = list(stub.Prefill(vpb.VerifierPrefillRequest(
            sequence_id=seq_id, prompt_ids=prompt, sampling=codec.encode_sampling(SamplingParams()),
            capacity=32, feature_kind=kind), timeout=30))[0].first_token
        tree = codec.decode_tree(_prefill_drafter(pipeline, f"d-{seq_id}", len(prompt),
                                                  torch.zeros(len(prompt), 64)).tree, 128)
        tree_msg = codec.encode_tree(tree)
        tree_msg.tokens.CopyFrom(codec.encode_tensor(torch.cat([torch.tensor([first]), tree.tokens[1:]])))
        response = stub.Verify(vpb.VerifyRequest(sequence_id=seq_id, round_index=1, tree=tree_msg), timeout=30)
        results[kind] = (list(response.tokens), response.bonus, list(response.features.shape))
        stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=10)
        pipeline.drafter_stub().Release(pb.ReleaseRequest(sequence_id=f"d-{seq_id}"), timeout=10)
    none, hidden = results[codec.WIRE_FEATURE_KINDS["none"]], results[codec.WIRE_FEATURE_KINDS["hidden"]]
    assert none[:2] == hidden[:2]
    assert none[2] == [0, 64] and hidden[2] == [len(hidden[0]), 64]
