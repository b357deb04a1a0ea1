"""`--executor ray`: the ranks of a tensor-parallel verifier group as Ray actors in a placement group
(one bundle per rank) on a local Ray cluster started once for this module. Through the services,
TP=2 greedy and seeded sampling stream exactly the in-process TP=1 tokens; a killed rank actor gives
UNAVAILABLE and health NOT_SERVING within the deadline."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ray = pytest.importorskip("ray")

from services.engine.engine import GenerationRequest  # noqa: E402
from tests.dist.test_tp_services import PROMPT, SAMPLINGS, remote, vpb_stream  # noqa: E402
from tests.pipeline import local_engine, local_run, start_pipeline, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="aerie-test")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pipeline(ray_cluster, model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, verifier_overrides={"tp": 2, "executor": "ray", "tp_timeout_s": 5.0})
    yield p
    p.close()


def test_ray_group_is_placed_one_bundle_per_rank(pipeline):
    from ray.util.placement_group import placement_group_table

    group = pipeline.verifier.group
    table = placement_group_table(group.executor.pg)
    assert table["strategy"] == "PACK" and list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    pids = group.executor.pids
    assert len(set(pids)) == 2 and os.getpid() not in pids  # two actor processes; none is this one


def test_ray_tp2_equals_tp1(pipeline, model_dirs):
    reference = local_engine(model_dirs)
    for sampling in SAMPLINGS:
        req = GenerationRequest(PROMPT, 24, sampling)
        assert remote(pipeline, req) == local_run(reference, req), sampling
    wait_until(lambda: pipeline.verifier.num_sequences == 0)


def test_ray_killed_rank_gives_unavailable_and_not_serving(pipeline):
    group = pipeline.verifier.group
    os.kill(group.executor.pids[1], signal.SIGKILL)
    health = health_pb2_grpc.HealthStub(pipeline.channel("verifier"))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(vpb_stream(pipeline.verifier_stub(), "after-kill"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    wait_until(lambda: health.Check(health_pb2.HealthCheckRequest()).status
               == health_pb2.HealthCheckResponse.NOT_SERVING)
    assert time.monotonic() - t0 < 120  # no hang (a bound for a failing test: load makes it slow, not wrong)
