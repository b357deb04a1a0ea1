"""KV growth and preemption through the real services (gRPC on loopback, tiny models, real Redis):
a sequence that cannot grow under the verifier's KV budget is preempted, its coordinator prefills it
again from its committed tokens once KV is released, and its output is still the target's greedy
output; the older sequence holding the budget is unaffected. Deterministic: the older sequence holds
its rows until the preemption is seen (no timing in what is asserted)."""

from __future__ import annotations

import threading

import grpc
import pytest

from services.engine.engine import GenerationRequest
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.spec.sampling import SamplingParams
from tests.pipeline import local_engine, local_run, remote_run, start_pipeline, wait_until

ROWS = 100  # the verifier's KV budget (512 bytes a row for the tiny target)


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, verifier_overrides=dict(
        kv_budget_mb=ROWS * 512 / 2 ** 20, kv_growth_rows=8, kv_wait_s=120))
    assert p.verifier.runner.pool.max_rows == ROWS
    yield p
    p.close()


def test_a_preempted_sequence_is_prefilled_again_and_yields_the_targets_tokens(pipeline, model_dirs):
    stub = pipeline.verifier_stub()
    servicer = pipeline.verifier
    # the older sequence, driven through the verifier itself: 3 prompt rows, then 45 decoded rows
    pre = list(stub.Prefill(vpb.VerifierPrefillRequest(
        sequence_id="old", prompt_ids=[1, 2, 3], capacity=60, sampling=pb.SamplingParams(),
        feature_kind=pb.FEATURE_KIND_NONE), timeout=30))
    old = [pre[0].first_token]

    def decode(k: int) -> None:
        for _ in range(k):
            r = stub.Decode(vpb.DecodeRequest(sequence_id="old", token=old[-1], round_index=len(old)), timeout=30)
            old.append(r.token)

    decode(45)
    held = servicer.verifier.reserved("old")
    assert 48 <= held < 60  # grown, not its worst case
    assert servicer.shares.held("anonymous") == held  # the share counts the rows reserved
    # the younger sequence, through the coordinator: it needs up to 5 + 40 + 16 rows, which cannot
    # fit next to "old": it grows until the budget is full, then is preempted
    req = GenerationRequest((9, 8, 7, 6, 5), 40, SamplingParams(), ignore_eos=True)
    result: dict = {}
    run = threading.Thread(target=lambda: result.setdefault("young", remote_run(pipeline, req)))
    run.start()
    wait_until(lambda: servicer.verifier.growth.preemptions >= 1)
    assert servicer.runner.pool.rows_allocated <= ROWS
    decode(8)  # "old" is unaffected: it goes on (its rebuild-free rows stay where they were)
    stub.Release(pb.ReleaseRequest(sequence_id="old"), timeout=10)  # KV released: the rebuild is admitted
    run.join(120)
    assert not run.is_alive()
    tokens, reason, _ = result["young"]
    assert reason == "length" and tokens == local_run(local_engine(model_dirs, with_drafter=False), req)[0]
    expected_old = local_run(local_engine(model_dirs, with_drafter=False),
                             GenerationRequest((1, 2, 3), len(old), SamplingParams(), ignore_eos=True))[0]
    assert old == expected_old
    wait_until(lambda: servicer.runner.pool.rows_allocated == 0)
    assert metric("aerie_failovers_total", role="verifier", reason="preempted") >= 1  # the coordinator's count
    assert metric("aerie:num_preemptions_total") >= 1  # the verifier's


def metric(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_call_on_a_preempted_sequence_names_the_preemption(pipeline):
    """The precise status a coordinator re-prefills on: NOT_FOUND saying the sequence was preempted."""
    servicer = pipeline.verifier
    stub = pipeline.verifier_stub()
    for s in ("a", "b"):
        list(stub.Prefill(vpb.VerifierPrefillRequest(
            sequence_id=s, prompt_ids=[1, 2, 3], capacity=ROWS, sampling=pb.SamplingParams(),
            feature_kind=pb.FEATURE_KIND_NONE), timeout=30))
    token = {"a": 1, "b": 1}
    preempted = None
    for k in range(1, ROWS):  # "a" (older) grows until "b" (younger) must give its KV back
        try:
            stub.Decode(vpb.DecodeRequest(sequence_id="b", token=token["b"], round_index=k), timeout=30)
        except grpc.RpcError as e:
            preempted = e
            break
        token["a"] = stub.Decode(vpb.DecodeRequest(sequence_id="a", token=token["a"], round_index=k),
                                 timeout=30).token
    assert preempted is not None and preempted.code() == grpc.StatusCode.NOT_FOUND
    assert "sequence 'b' was preempted" in preempted.details() and "KV budget of 100 rows" in preempted.details()
    assert "b" not in servicer.shares._rows and servicer.verifier.has("a")
    # its rebuild goes first: while it waits for KV, a new sequence whose KV would fit is not admitted
    free = ROWS - servicer.runner.pool.rows_allocated
    rebuild = threading.Thread(target=lambda: list(stub.Prefill(vpb.VerifierPrefillRequest(
        sequence_id="b", prompt_ids=[1] * free, capacity=free + 20, sampling=pb.SamplingParams(),
        feature_kind=pb.FEATURE_KIND_NONE, rebuild=True), timeout=60)))  # free + 8 rows: waits for "a"
    rebuild.start()
    wait_until(lambda: servicer._rebuilds_waiting == {"b"})
    with pytest.raises(grpc.RpcError) as e:  # 10 rows would fit: refused while "b" waits
        list(stub.Prefill(vpb.VerifierPrefillRequest(
            sequence_id="c", prompt_ids=[1, 2, 3], capacity=10, sampling=pb.SamplingParams(),
            feature_kind=pb.FEATURE_KIND_NONE), timeout=1))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not servicer.verifier.has("c")
    stub.Release(pb.ReleaseRequest(sequence_id="a"), timeout=10)  # KV for "b"
    rebuild.join(60)
    assert not rebuild.is_alive() and servicer.verifier.has("b") and servicer.verifier.reserved("b") == free + 8
    for s in ("b", "c"):
        stub.Release(pb.ReleaseRequest(sequence_id=s), timeout=10)
    wait_until(lambda: servicer.runner.pool.rows_allocated == 0)


@pytest.fixture(scope="module")
def shared(model_dirs):
    """A verifier whose Prefills do not wait for KV (refusals answer at once), with client shares."""
    from services.rpc.channel import open_channel
    from services.rpc.config import ServiceConfig
    from services.rpc.stubs import verifier_grpc
    from tests.pipeline import HOST, LoopThread
    from verifier_svc.config import VerifierConfig
    from verifier_svc.server import create_server, load_servicer

    loop = LoopThread()
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            kv_budget_mb=ROWS * 512 / 2 ** 20, kv_wait_s=0, kv_client_share=0.5, kv_growth_rows=8)
    servicer = load_servicer(config)
    server, port = loop.run(create_server(f"{HOST}:0", config, servicer))
    channel = open_channel(f"{HOST}:{port}", config.service.max_message_bytes)
    yield servicer, verifier_grpc.VerifierStub(channel)
    channel.close()
    loop.run(server.stop(None))
    servicer.close()
    loop.close()


def test_shares_count_the_rows_reserved_not_the_capacity(shared):
    """Four sequences of capacity 90 fit a client's 50-row share (11 rows reserved each); the fifth
    passes it; a slot that grows counts its new rows."""
    servicer, stub = shared

    def prefill(seq_id: str, client: str):
        req = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=[1, 2, 3], capacity=90,
                                         sampling=pb.SamplingParams(), feature_kind=pb.FEATURE_KIND_NONE)
        return list(stub.Prefill(req, timeout=30, metadata=(("aerie-client", client),)))

    prefill("y0", "y")
    for i in range(4):
        prefill(f"x{i}", "x")
    assert servicer.shares.held("x") == 44 and servicer.runner.pool.rows_allocated == 55
    with pytest.raises(grpc.RpcError) as e:
        prefill("x4", "x")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "client 'x' holds 44 KV rows; 11 more would pass its share of 50 rows" in e.value.details()
    token = 1
    for k in range(1, 10):  # y0 writes 9 rows after its 3: the 9th is its 12th, past its 11
        token = stub.Decode(vpb.DecodeRequest(sequence_id="y0", token=token, round_index=k), timeout=30).token
    # the slot grew to the 12 rows needed + 8, and the share counts them
    assert servicer.shares.held("y") == servicer.verifier.reserved("y0") == 12 + 8
    for s in ("y0", "x0", "x1", "x2", "x3"):
        stub.Release(pb.ReleaseRequest(sequence_id=s), timeout=10)
    assert servicer.runner.pool.rows_allocated == 0 and servicer.shares.held("x") == 0
