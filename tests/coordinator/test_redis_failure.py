"""Redis failing in the middle of a sequence: the stream ends with a precise status naming Redis, the
KV is freed on both services, and Redis holds exactly the rounds that were streamed (nothing twice,
nothing streamed that is not committed)."""

import grpc
import pytest
import redis

from coordinator.redis_server import start_redis, stop_process
from services.engine.engine import GenerationRequest
from services.rpc import codec
from services.rpc.channel import open_channel
from services.rpc.stubs import coordinator_grpc
from tests.pipeline import start_pipeline, wait_until


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    yield p
    p.close()


@pytest.fixture
def own_redis(tmp_path):
    proc, url = start_redis(tmp_path / "redis")
    yield proc, url
    stop_process(proc)


def kv_free(p) -> bool:
    return p.verifier.num_sequences == 0 and p.drafter.drafter.num_sequences == 0


def stream_until_redis_fails(pipeline, url, break_redis):
    coordinator, address = pipeline.add_coordinator(url)
    with open_channel(address, 1 << 22) as ch:
        stream = coordinator_grpc.CoordinatorStub(ch).Generate(
            codec.encode_generation_request(GenerationRequest((1, 2, 3), 400), "redis-dies"), timeout=60)
        messages = [next(stream), next(stream), next(stream)]
        break_redis()
        with pytest.raises(grpc.RpcError) as e:
            for m in stream:
                messages.append(m)
    return coordinator, messages, e.value


def test_redis_refusing_writes_mid_sequence(pipeline, own_redis):
    _, url = own_redis
    admin = redis.Redis.from_url(url)
    coordinator, messages, error = stream_until_redis_fails(
        pipeline, url, lambda: admin.config_set("min-replicas-to-write", 1))  # every write now fails
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "Redis refused the command for sequence 'redis-dies'" in error.details() and "NOREPLICAS" in error.details()
    wait_until(lambda: kv_free(pipeline))
    admin.config_set("min-replicas-to-write", 0)
    state = coordinator.store.get("redis-dies")
    assert state.tokens == [t for m in messages for t in m.tokens]  # exactly what was streamed, once
    assert state.round_index == len(messages) - 1 and all(m.finish_reason == "" for m in messages)


def test_redis_gone_mid_sequence(pipeline, own_redis):
    proc, url = own_redis
    _, messages, error = stream_until_redis_fails(pipeline, url, lambda: stop_process(proc))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details().startswith("Redis is unavailable")
    assert len(messages) >= 3 and all(m.finish_reason == "" for m in messages)
    wait_until(lambda: kv_free(pipeline))


def test_health_tracks_redis(pipeline, tmp_path):
    """A real Redis stopped and restarted on the same port: the coordinator's gRPC health check says
    NOT_SERVING while it is down and SERVING again once it is back (redis-py reconnects; the watch
    retries with backoff), and the coordinator serves again."""
    import re

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from coordinator.redis_server import start_redis, stop_process
    from tests.pipeline import wait_until

    proc, url = start_redis(tmp_path / "health", appendfsync="everysec")
    port = int(re.search(r":(\d+)", url).group(1))
    coordinator, address = pipeline.add_coordinator(url, redis_retry_s=0.5)
    health = health_pb2_grpc.HealthStub(pipeline.channel_to(address))

    def status(service=""):
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert status() == serving and status("aerie.v1.Coordinator") == serving
        stop_process(proc)
        wait_until(lambda: status() == not_serving and status("aerie.v1.Coordinator") == not_serving)
        with pytest.raises(grpc.RpcError) as e:  # and it cannot admit (Redis named)
            list(coordinator_grpc.CoordinatorStub(pipeline.channel_to(address)).Generate(
                codec.encode_generation_request(GenerationRequest((1, 2, 3), 4), "health-down"), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in e.value.details()
        proc, _ = start_redis(tmp_path / "health", port, appendfsync="everysec")
        wait_until(lambda: status() == serving and status("aerie.v1.Coordinator") == serving)
        msgs = list(coordinator_grpc.CoordinatorStub(pipeline.channel_to(address)).Generate(
            codec.encode_generation_request(GenerationRequest((1, 2, 3), 4), "health-back"), timeout=30))
        assert sum(len(m.tokens) for m in msgs) == 4 and msgs[-1].finish_reason == "length"
        assert coordinator.redis_watch.up is True
    finally:
        stop_process(proc)


def test_health_follows_a_stalled_redis(pipeline, tmp_path):
    """A Redis that keeps its connections but answers nothing (SIGSTOP): health turns NOT_SERVING
    after one bounded PING (AERIE_REDIS_PING_TIMEOUT_S), not after the store's own socket timeout and
    retries (which outlast the 30 s waited here), and SERVING again once Redis answers (SIGCONT)."""
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from coordinator.redis_server import start_redis, stop_process

    proc, url = start_redis(tmp_path / "stalled")
    coordinator, address = pipeline.add_coordinator(url, redis_ping_timeout_s=0.5)
    health = health_pb2_grpc.HealthStub(pipeline.channel_to(address))

    def status():
        return health.Check(health_pb2.HealthCheckRequest(service="aerie.v1.Coordinator"), timeout=10).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        wait_until(lambda: status() == serving, 30)
        proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: status() == not_serving, 30)
        assert coordinator.redis_watch.up is False
        proc.send_signal(signal.SIGCONT)
        wait_until(lambda: status() == serving, 30)
    finally:
        proc.send_signal(signal.SIGCONT)
        stop_process(proc)
