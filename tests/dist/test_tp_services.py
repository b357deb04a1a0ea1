"""A tensor-parallel verifier group through the services (real gRPC, real Redis, real processes):
`aerie verifier --tp 2` (rank 0 serves, rank 1 is a local child process over gloo) streams exactly
what the in-process TP=1 engine produces, greedy and seeded sampling, with EAGLE-2 and EAGLE-3
heads and plain decoding of a Qwen2-style model; a rank killed mid-run turns into UNAVAILABLE and
health NOT_SERVING within the collective deadline, never a hang."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.engine import GenerationRequest
from services.model.head_checkpoint import save_head
from services.spec.sampling import SamplingParams
from tests.pipeline import ModelDirs, local_engine, local_run, remote_run, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)
TP = {"tp": 2, "tp_timeout_s": 10.0}
SAMPLINGS = [SamplingParams(), SamplingParams(0.8, 0.95, 0, 11)]


remote = remote_run


def test_tp2_eagle2_equals_tp1(model_dirs, redis_url):
    """One process holds one group (torch.distributed's default group): each test starts and closes its own."""
    p = start_pipeline(model_dirs, redis_url, verifier_overrides=TP)
    try:
        assert p.verifier.group is not None and p.verifier.group.world == 2
        reference = local_engine(model_dirs)
        for sampling in SAMPLINGS:
            req = GenerationRequest(PROMPT, 32, sampling)
            got = remote(p, req)
            assert got == local_run(reference, req), sampling
            if sampling.greedy:
                assert max(got[2]) > 1  # speculation really happens through the group
            assert remote(p, req) == got  # and replays identically
        wait_until(lambda: p.verifier.num_sequences == 0)
    finally:
        p.close()


@pytest.fixture(scope="module")
def eagle3_dirs(eagle3_pair, tmp_path_factory):
    hf, _, head = eagle3_pair
    root = tmp_path_factory.mktemp("tp-eagle3")
    hf.save_pretrained(root / "target")
    save_head(head, root / "head")
    return ModelDirs(root / "target", root / "head")


def test_tp2_eagle3_equals_tp1(eagle3_dirs, redis_url):
    p = start_pipeline(eagle3_dirs, redis_url, verifier_overrides=TP)
    try:
        assert p.drafter.drafter.head.feature_kind == "taps"  # the taps come from the sharded target
        reference = local_engine(eagle3_dirs)
        for sampling in SAMPLINGS:
            req = GenerationRequest(PROMPT, 24, sampling)
            assert remote(p, req) == local_run(reference, req), sampling
    finally:
        p.close()


def test_tp2_qwen2_plain_decoding_equals_tp1(tmp_path, redis_url):
    from tests.helpers import tiny_hf

    hf = tiny_hf("qwen2", layers=2, seed=3)
    hf.save_pretrained(tmp_path / "target")
    dirs = ModelDirs(tmp_path / "target", tmp_path / "none")
    p = start_pipeline(dirs, redis_url, with_drafter=False, verifier_overrides=TP)
    try:
        req = GenerationRequest(PROMPT, 16)
        expected = local_run(local_engine(dirs, with_drafter=False), req)
        assert remote(p, req) == expected
        # a coordinator with no drafter pool decodes in plain runs (DecodeRun through the group's servicer)
        from prometheus_client import REGISTRY

        def runs() -> float:
            return REGISTRY.get_sample_value("aerie_plain_run_rounds_total", {"service": "coordinator"}) or 0.0

        p.coordinator, p.addresses["coordinator"] = p.add_coordinator(redis_url, drafters=(), discover=False)
        before = runs()
        assert remote(p, req) == expected
        assert runs() - before == 15
    finally:
        p.close()


def test_a_killed_rank_gives_unavailable_and_not_serving(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, verifier_overrides={"tp": 2, "tp_timeout_s": 3.0})
    try:
        group = p.verifier.group
        worker_pid = group._on_close.__self__.pids[0]  # the LocalExecutor's rank-1 process
        health = health_pb2_grpc.HealthStub(p.channel("verifier"))
        status = lambda: health.Check(health_pb2.HealthCheckRequest()).status  # noqa: E731
        assert status() == health_pb2.HealthCheckResponse.SERVING
        assert remote(p, GenerationRequest(PROMPT, 8))[0]  # serving through the group
        os.kill(worker_pid, signal.SIGKILL)
        stub = p.verifier_stub()

        def prefill(seq_id: str) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as info:
                list(vpb_stream(stub, seq_id))
            return info.value

        t0 = time.monotonic()
        err = prefill("after-kill")
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "tensor-parallel" in err.details(), err
        wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        # no hang: the collective's 3 s deadline ended the call (60 s only bounds a failing test: a
        # loaded machine is slow, not wrong)
        assert time.monotonic() - t0 < 60
        # a later call fails at once: the group is known to be down, no collective is tried (said by
        # the error, not by a wall-clock bound)
        later = prefill("later")
        assert later.code() == grpc.StatusCode.UNAVAILABLE and "ranks is down" in later.details(), later
    finally:
        p.close()


def vpb_stream(stub, seq_id: str):
    from services.rpc.stubs import verifier as vpb

    return stub.Prefill(vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=list(PROMPT), capacity=64,
                                                   feature_kind=1),  # HIDDEN
                        timeout=30)


def test_tp2_slots_grow_in_step_on_every_rank(model_dirs, redis_url):
    """KV growth through the group (GroupRunner.grow, broadcast like every runner call): a 4-row
    increment grows each sequence's slot on both ranks many times and the output stays TP=1's."""
    p = start_pipeline(model_dirs, redis_url, verifier_overrides={**TP, "kv_growth_rows": 4})
    grown: list[int] = []
    hold = p.verifier.verifier.growth.on_grow
    p.verifier.verifier.growth.on_grow = lambda s, rows: (grown.append(rows), hold(s, rows))
    try:
        req = GenerationRequest(PROMPT, 32, SamplingParams())
        assert remote(p, req) == local_run(local_engine(model_dirs), req)
        assert len(grown) >= 3
        wait_until(lambda: p.verifier.num_sequences == 0)
    finally:
        p.close()
