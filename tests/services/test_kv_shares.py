"""Per-client KV shares and the step budget through a real verifier (gRPC on loopback, tiny model):
while another client wants KV, the greedy client's Prefill past its share of the KV budget is
refused naming the share and the other client's is admitted; alone a client may use the whole
budget; the coordinator's verifier client sends the identity; the prefill chunk GetInfo reports is
cut to the step budget the cost model gives for --itl-target-ms."""

from __future__ import annotations

import grpc
import pytest

from services.rpc.channel import open_channel
from services.rpc.config import ServiceConfig
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.budget import CostCurve
from tests.pipeline import HOST, LoopThread
from verifier_svc.config import VerifierConfig
from verifier_svc.server import create_server as create_verifier
from verifier_svc.server import load_servicer as load_verifier
from verifier_svc.servicer import VerifierServicer

ROWS = 100  # KV budget in rows (512 bytes a row for the tiny target)


@pytest.fixture(scope="module")
def verifier(model_dirs):
    loop = LoopThread()
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            kv_budget_mb=ROWS * 512 / 2 ** 20, kv_wait_s=0, kv_client_share=0.5)
    servicer = load_verifier(config)
    assert servicer.runner.pool.max_rows == ROWS
    server, port = loop.run(create_verifier(f"{HOST}:0", config, servicer))
    channel = open_channel(f"{HOST}:{port}", config.service.max_message_bytes)
    servicer.test_address = f"{HOST}:{port}"  # for a coordinator-side client
    yield servicer, verifier_grpc.VerifierStub(channel)
    channel.close()
    loop.run(server.stop(None))
    servicer.close()
    loop.close()


def prefill(stub, seq_id: str, capacity: int, client: str | None):
    req = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=[1, 2, 3], capacity=capacity,
                                     sampling=pb.SamplingParams(), feature_kind=pb.FEATURE_KIND_NONE)
    metadata = (("aerie-client", client),) if client else None
    return list(stub.Prefill(req, timeout=30, metadata=metadata))


def release(stub, *seq_ids: str) -> None:
    for s in seq_ids:
        stub.Release(pb.ReleaseRequest(sequence_id=s), timeout=10)


def test_kv_shares_refuse_the_greedy_client_not_the_others(verifier):
    servicer, stub = verifier
    prefill(stub, "g1", 25, "greedy")
    prefill(stub, "g2", 25, "greedy")  # 50 rows: its share (0.5 x 100)
    prefill(stub, "o1", 20, "other")
    # the greedy client past its share while another client holds KV: refused, naming the share
    with pytest.raises(grpc.RpcError) as e:
        prefill(stub, "g3", 20, "greedy")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "client 'greedy' holds 50 KV rows" in e.value.details()
    assert "share of 50 rows" in e.value.details() and "AERIE_KV_CLIENT_SHARE" in e.value.details()
    # the other client is admitted into the rows the greedy one could not take
    prefill(stub, "o2", 25, "other")
    assert servicer.runner.pool.rows_allocated == 95 and servicer.num_sequences == 4
    assert servicer.shares.held("greedy") == 50 and servicer.shares.held("other") == 45
    release(stub, "g1", "g2", "o1", "o2")
    assert servicer.runner.pool.rows_allocated == 0 and servicer.shares.held("greedy") == 0


def test_alone_a_client_may_use_the_whole_budget(verifier):
    servicer, stub = verifier
    for i in range(4):
        prefill(stub, f"a{i}", 25, "alone")  # 100 rows: no other client wants KV
    assert servicer.runner.pool.rows_allocated == ROWS
    # the budget is full: a newcomer waits (here kv_wait_s 0: refused naming the budget, not a share)
    with pytest.raises(grpc.RpcError) as e:
        prefill(stub, "n1", 10, "newcomer")
    assert "KV budget of 100 rows" in e.value.details() and "share" not in e.value.details()
    release(stub, "a0")
    prefill(stub, "n1", 10, "newcomer")
    # the newcomer holds KV now: the first client is past its share, its next Prefill is refused
    with pytest.raises(grpc.RpcError) as e:
        prefill(stub, "a4", 10, "alone")
    assert "client 'alone' holds 75 KV rows" in e.value.details()
    release(stub, "a1", "a2", "a3", "n1")
    assert servicer.runner.pool.rows_allocated == 0


def test_the_coordinator_client_sends_the_identity(verifier):
    """RemoteVerifier (the coordinator's side) sends its sequence's kv_client with every Prefill."""
    import torch

    from services.rpc.clients import VerifierClient
    from services.spec.sampling import SamplingParams

    servicer, _ = verifier
    client = VerifierClient(servicer.test_address, 4 * 2 ** 20, 30.0)
    try:
        rv = client.for_sequence("none", client="identity alice")
        rv.prefill("c1", torch.tensor([1, 2, 3]), SamplingParams(), capacity=10)
        assert servicer.shares.client_of("c1") == "identity alice" and servicer.shares.held("identity alice") == 10
        rv.release("c1")
    finally:
        client.close()


def test_the_step_budget_follows_the_cost_model_and_the_chunk_stays(verifier, model_dirs):
    """The budget comes from the cost curve and the ITL target; the RPC's prefill chunk stays as
    configured (steps slice it: tests/engine/test_step_scheduler.py)."""
    servicer, _ = verifier
    cost = CostCurve((1, 1000), (0.05, 1.049))  # 50 ms + 1 ms per extra row: 151 rows fit 200 ms
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            itl_target_ms=200, prefill_chunk=512, kv_budget_mb=1.0)
    cut = VerifierServicer(servicer.target, config, servicer.target_path, servicer.eos_token_ids, cost)
    off = VerifierServicer(servicer.target, VerifierConfig(ServiceConfig(host=HOST), itl_target_ms=0,
                                                           kv_budget_mb=1.0),
                           servicer.target_path, servicer.eos_token_ids, cost)
    try:
        assert cut.step_rows == 151 and cut.prefill_chunk == 512 and cut.batcher.step_rows == 151
        assert off.step_rows is None and off.prefill_chunk == 512  # 0 = off: as configured
    finally:
        cut.close()
        off.close()
