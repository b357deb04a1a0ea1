"""The codec: tensors, chunks and trees survive the wire bit for bit, and every malformed input is
an InvalidRequest naming the field."""

import pytest
import torch

from services.errors import InvalidRequest
from services.rpc import codec
from services.rpc.stubs import common as pb
from services.spec.tree import DraftTree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool])
def test_tensor_roundtrip_is_bit_exact(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    back = codec.decode_tensor(codec.encode_tensor(t), "x")
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    empty = codec.decode_tensor(codec.encode_tensor(torch.empty(0, 4, dtype=dtype)), "x")
    assert empty.shape == (0, 4) and empty.dtype == dtype


def test_chunks_reassemble_and_respect_the_size():
    t = torch.randn(37, 11).to(torch.bfloat16)
    chunks = list(codec.tensor_chunks(t, 100, first_chunk_bytes=30))
    assert len(chunks[0].data) == 30 and all(len(c.data) <= 100 for c in chunks)
    assert all(not c.shape and not c.dtype for c in chunks[1:])
    asm = codec.TensorAssembler("features", dtype=torch.bfloat16, shape=(37, 11))
    for c in chunks:
        asm.add(c)
    assert torch.equal(asm.result(), t)


BAD_TENSORS = [
    (pb.Tensor(dtype=99, shape=[1], data=b"\0" * 4), {}, "x has an unknown dtype (99)"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20), {}, "x has 20 bytes; dtype float32 and shape [2, 3] need 24"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1], data=b""), {}, "negative dimension"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"\0" * 8), {"dtype": torch.bfloat16}, "x must be bfloat16; got float32"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"\0" * 8), {"shape": (2, None)}, "x must have shape [2, *]; got [2]"),
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[4, 64], data=b""), {"shape": (4, 32)}, "x must have shape [4, 32]; got [4, 64]"),
    (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1000], data=b""), {"max_bytes": 4096}, "x is 8000 bytes (shape [1000]), over the limit of 4096"),
]


@pytest.mark.parametrize("msg,kw,message", BAD_TENSORS, ids=[m[:24] for _, _, m in BAD_TENSORS])
def test_malformed_tensors(msg, kw, message):
    with pytest.raises(InvalidRequest, match=None) as e:
        codec.decode_tensor(msg, "x", **kw)
    assert message in str(e.value)


def test_assembler_refuses_bad_streams():
    asm = codec.TensorAssembler("f", shape=(2, 2))
    asm.add(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], data=b"\0" * 8))
    with pytest.raises(InvalidRequest, match="only the first chunk may carry dtype and shape"):
        asm.add(pb.Tensor(dtype=pb.DTYPE_FLOAT32, data=b"\0" * 8))
    with pytest.raises(InvalidRequest, match="f has 8 bytes; dtype float32 and shape \\[2, 2\\] need 16"):
        asm.result()
    with pytest.raises(InvalidRequest, match="chunks add up to more than the 16 bytes"):
        asm.add(pb.Tensor(data=b"\0" * 12))
    with pytest.raises(InvalidRequest, match="f is 4000000 bytes"):  # refused before any bytes arrive
        codec.TensorAssembler("f", max_bytes=1000).add(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1000, 1000]))


def tree() -> DraftTree:
    # the worked example of services/spec/tree.py rerank: K=2, D=2, size=6, root 16
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    tokens = torch.tensor([16, 18, 0, 24, 16, 24])
    paths = torch.tensor([[0, 1, 3], [0, 1, 4], [0, 2, 5]])
    # written out by hand (eagle.md's worked example), not computed by the codec under test
    depths = torch.tensor([0, 1, 1, 2, 2, 2])
    mask = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    return DraftTree(tokens, parents, depths, mask, paths, torch.linspace(0, -2, 6))


def test_tree_roundtrip_rebuilds_mask_and_depths():
    t = tree()  # the wire carries tokens, parents, paths and scores; depths and mask are rebuilt
    back = codec.decode_tree(codec.encode_tree(t), vocab_size=128)
    for name in ("tokens", "parents", "depths", "mask", "paths", "scores"):
        assert torch.equal(getattr(back, name), getattr(t, name)), name


def _with(**fields):
    msg = codec.encode_tree(tree())
    for name, value in fields.items():
        getattr(msg, name).CopyFrom(codec.encode_tensor(value))
    return msg


BAD_TREES = [
    (_with(tokens=torch.tensor([16, 18, 0, 24, 16, 200])), "tree token id 200 at position 5 is outside the vocabulary [0, 128)"),
    (_with(tokens=torch.tensor([16.0] * 6)), "tree.tokens must be int64; got float32"),
    (_with(parents=torch.tensor([0, 0, 0, 1, 1, 2])), "tree.parents[0] must be -1"),
    (_with(parents=torch.tensor([-1, 0, 0, 4, 1, 2])), "tree.parents[3] must be in [0, 3)"),
    (_with(parents=torch.tensor([-1, 0, 0, 1])), "tree.parents must have shape [6]; got [4]"),
    (_with(paths=torch.tensor([[0, 1, 3], [0, 2, 4]])), "tree.paths row 1 is not a root-to-leaf chain"),
    (_with(paths=torch.tensor([[1, 3, -1]])), "must start at the root"),
    (_with(paths=torch.tensor([[0, -1, 3]])), "padded with -1 only at the end"),
    (_with(paths=torch.tensor([[0, 1, 9]])), "node indices in [0, 6)"),
    (_with(paths=torch.tensor([[0, 1]])), "tree.paths must have shape [*, 3]; got [1, 2]"),
    (_with(scores=torch.zeros(6, dtype=torch.int64)), "tree.scores must be float32; got int64"),
]


@pytest.mark.parametrize("msg,message", BAD_TREES, ids=[m[:28] for _, m in BAD_TREES])
def test_malformed_trees(msg, message):
    with pytest.raises(InvalidRequest) as e:
        codec.decode_tree(msg, vocab_size=128)
    assert message in str(e.value)


def test_parameters():
    s = codec.decode_sampling(pb.SamplingParams(temperature=0.7, top_k=5, seed=3))
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 1.0, 5, 3)
    with pytest.raises(InvalidRequest, match="top_p must be in \\(0, 1\\]; got 0.0"):
        codec.decode_sampling(pb.SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequest, match="seed must be in \\[0, 2\\*\\*63\\)"):
        codec.decode_sampling(pb.SamplingParams(seed=2**63))
    with pytest.raises(InvalidRequest, match="sequence_id must be 1-128 characters"):
        codec.sequence_id("bad id!")
    with pytest.raises(InvalidRequest, match="feature_kind must be HIDDEN, TAPS or NONE; got 0"):
        codec.feature_kind(0)


def test_verify_result_carries_accepted_and_reads_an_older_verifiers_accept_length():
    """`accepted` (m) is new; `accept_length` (m, deprecated on the verifier's wire) is still filled
    for older coordinators and still read from older verifiers."""
    from services.engine.verifier import VerifyResult
    from services.rpc.stubs import verifier as vpb
    from services.spec.verify import Acceptance

    acc = Acceptance(path=1, accepted=2, nodes=torch.tensor([0, 1, 4]), tokens=torch.tensor([7, 8, 9]), bonus=5)
    msg = codec.encode_verify_result(VerifyResult(acc, torch.zeros(3, 2)))
    assert msg.accepted == msg.accept_length == 2
    assert codec.decode_verify_result(msg).acceptance.accepted == 2
    older = vpb.VerifyResponse(path=1, accept_length=2, nodes=[0, 1, 4], tokens=[7, 8, 9], bonus=5,
                               features=codec.encode_tensor(torch.zeros(3, 2)))
    assert codec.decode_verify_result(older).acceptance.accepted == 2
    with pytest.raises(InvalidRequest, match="verify result has 3 nodes and 3 tokens for accepted 1"):
        codec.decode_verify_result(vpb.VerifyResponse(accepted=1, nodes=[0, 1, 4], tokens=[7, 8, 9]))


def test_a_rounds_kind_crosses_the_api():
    """What kind of round it was (detached, from a plain run, from a tree run, drafted inside the Verify)
    reaches a client of the coordinator as the engine recorded it (bench/measure_round_mix.py sorts
    rounds by it)."""
    from services.engine.engine import RoundStats

    for kind in ({"detached": True}, {"run": True}, {"tree_run": True, "drafted_in_verify": True}, {}):
        stats = RoundStats(round_index=2, accept_length=1, tree_size=0, tree_max_depth=0, draft_s=0.0,
                           verify_s=0.1, **kind)
        assert codec.decode_stats(codec.encode_stats(stats)) == stats, kind


def test_round_index_and_tree_max_depth_fill_the_deprecated_copies_and_read_an_older_peers():
    """RoundStats.round_index / tree_max_depth and Sequence.round_index are new; RoundStats.index /
    tree_depth and Sequence.round (deprecated) are still filled for older clients, and read when an
    older coordinator sent only them."""
    from services.engine.engine import RoundStats
    from services.rpc.stubs import coordinator as cpb

    stats = RoundStats(round_index=3, accept_length=2, tree_size=8, tree_max_depth=2, draft_s=0.5, verify_s=0.25)
    msg = codec.encode_stats(stats, commit_s=0.1)
    assert msg.round_index == msg.index == 3
    assert codec.decode_stats(msg) == stats
    assert msg.tree_max_depth == msg.tree_depth == 2  # tree_depth: the deprecated copy
    older = codec.decode_stats(cpb.RoundStats(index=3, accept_length=2, tree_depth=2))  # an older coordinator
    assert older.round_index == 3 and older.tree_max_depth == 2
    assert codec.round_only_stats(4).round_index == codec.round_only_stats(4).index == 4
    assert codec.decode_round_index(cpb.Sequence(round=-1)) == -1  # an older coordinator, before the prefill
    assert codec.decode_round_index(cpb.Sequence(round_index=0, round=0)) == 0
    assert codec.decode_round_index(cpb.Sequence(round_index=5, round=5)) == 5
