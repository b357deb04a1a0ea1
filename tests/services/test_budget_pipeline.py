"""The auto budget and retrieval through the real services: the coordinator builds the same budget
from the verifier's and drafter's GetInfo (cost curves, head prior, largest shape) as the in-process
engine, so a greedy stream equals the in-process one token for token and round for round; a tree
shape beyond the drafter's largest is refused with a message naming it."""

import grpc
import pytest
import torch

from services.engine.engine import GenerationRequest
from services.engine.local import build_local_engine
from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.spec.budget import AUTO_LARGEST
from services.spec.tree import TreeParams
from tests.helpers import hf_greedy
from tests.pipeline import local_run, remote_run, start_pipeline

PROMPT = (5, 17, 99, 3, 42, 8, 5, 17, 99, 3)


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, tree=None, retrieval=True)
    yield p
    p.close()


def test_drafter_reports_costs_and_auto_shape(pipeline):
    info = pipeline.drafter_stub().GetInfo(pb.InfoRequest())
    assert not info.fixed_tree and codec.decode_tree_params(info.tree) == AUTO_LARGEST
    assert len(info.head_cost.rows) > 1 and all(s > 0 for s in info.logits_cost.seconds)
    vinfo = pipeline.verifier_stub().GetInfo(pb.InfoRequest())
    assert vinfo.verify_cost.rows[0] == 1 and len(vinfo.verify_cost.seconds) == len(vinfo.verify_cost.rows)


def test_auto_budget_with_retrieval_streams_what_the_in_process_engine_does(pipeline, model_dirs, llama_pair,
                                                                           monkeypatch):
    """The coordinator's load board also charges the latencies it measures (draft and verify round
    trips), which the in-process engine has not got: with them, the stream is still the target's
    greedy one; with that measurement off, it is the in-process engine's round for round."""
    from services.spec.load_board import LoadBoard

    hf = llama_pair[0]
    local = build_local_engine(str(model_dirs.target), f"{model_dirs.head}+sam", "fp32", None).engine
    assert local.retrieval and local.budget.fixed is None
    req = GenerationRequest(PROMPT, 40)

    def remote():
        return remote_run(pipeline, req)

    with monkeypatch.context() as m:  # first, on a board that has measured nothing yet
        m.setattr(LoadBoard, "_observe", lambda self, kind, x, decay=False: None)
        assert remote() == local_run(local, req)
    tokens, _, _ = remote()
    assert tokens == hf_greedy(hf, list(PROMPT), 40)
    # the extras the budget charged are exported per verifier (aerie_budget_extra_seconds)
    from prometheus_client import REGISTRY

    boards = pipeline.coordinator.sequences._boards
    assert len(boards) == 1
    (address, board), = boards.items()
    measured = board.extras()
    # both on any machine: whatever the calibration, a lone sequence drafts a tree at least at its probe
    # (after 16 plain rounds; 40 tokens), and that round's draft and verify are measured
    assert {"draft", "verify"} <= set(measured)
    for kind, seconds in measured.items():
        labels = {"service": "coordinator", "verifier": address, "kind": kind}
        assert REGISTRY.get_sample_value("aerie_budget_extra_seconds", labels) == seconds, kind


def test_a_shape_beyond_the_largest_is_refused(pipeline):
    big = TreeParams(AUTO_LARGEST.top_k, AUTO_LARGEST.depth + 1, 12)  # more draft-KV rows
    f = pipeline.drafter_stub().GetInfo(pb.InfoRequest()).feature_size
    request = dpb.DraftRequest(sequence_id="s", round_index=2, tokens=[1], tree=codec.encode_tree_params(big),
                               features=codec.encode_tensor(torch.zeros(1, f)))
    with pytest.raises(grpc.RpcError) as e:
        pipeline.drafter_stub().Draft(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"depth={big.depth}" in e.value.details() and "largest" in e.value.details()


def test_drafter_tree_flags_auto_or_fixed(monkeypatch):
    import argparse

    from drafter_svc.config import add_flags, from_args

    for name in ("AERIE_TREE_TOP_K", "AERIE_TREE_DEPTH", "AERIE_TREE_TOKENS"):
        monkeypatch.delenv(name, raising=False)

    def parse(*argv):
        p = argparse.ArgumentParser()
        add_flags(p)
        return from_args(p.parse_args(list(argv))).tree

    assert parse() is None and parse("--tree-top-k", "auto") is None
    assert parse("--tree-top-k", "3", "--tree-depth", "2", "--tree-tokens", "9") == TreeParams(3, 2, 9)
    monkeypatch.setenv("AERIE_TREE_TOKENS", "auto")  # the chart's default
    assert parse() is None
