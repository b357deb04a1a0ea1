"""Requests per second per client (coordinator/rate_limit.py): a token bucket per client key, pure
with a fake clock; through a real coordinator (gRPC: RESOURCE_EXHAUSTED with `retry-after`) and the
HTTP API (429, Retry-After), other clients unaffected. The rate in the service tests refills one
token in 1000 s, so no test depends on how long a step takes (the waits are checked within 100 s)."""

import grpc
import httpx
import pytest

from coordinator.rate_limit import RateLimited, RateLimits
from gateway.server import start_http
from services.rpc.config import ConfigError
from services.rpc.errors import RETRY_AFTER
from services.rpc.forwarded import FORWARDED_FOR
from services.rpc.stubs import coordinator as cpb
from tests.pipeline import HOST, start_pipeline


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_admits_its_burst_then_the_rate():
    clock = Clock()
    limits = RateLimits(rate_per_s=2.0, burst=3, clock=clock)
    assert [limits.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limits.take("a") == pytest.approx(0.5)  # one token in 1 / 2 s
    assert limits.take("a") == pytest.approx(0.5)  # a refusal takes nothing
    assert limits.take("b") == 0.0  # another client has its own bucket
    clock.now += 0.25
    assert limits.take("a") == pytest.approx(0.25)
    clock.now += 0.25
    assert limits.take("a") == 0.0 and limits.take("a") == pytest.approx(0.5)
    clock.now += 100  # refills to the burst, never past it
    assert [limits.take("a") for _ in range(4)][-1] == pytest.approx(0.5)
    with pytest.raises(RateLimited, match=r"a is over its rate limit of 2 requests/s \(burst 3; "
                                          r"AERIE_RATE_LIMIT_RPS, AERIE_RATE_LIMIT_BURST\): retry in 0.50 s"):
        limits.check("a")


def test_off_by_default_and_bounded_memory():
    assert RateLimits(0.0, 20).take("a") == 0.0 and not RateLimits(0.0, 20).on
    clock = Clock()
    limits = RateLimits(rate_per_s=1.0, burst=1, clock=clock, max_clients=2)
    for client in ("a", "b"):
        limits.take(client)
    clock.now += 10  # a and b have refilled: dropped when a third client grows the map
    limits.take("c")
    assert set(limits._buckets) == {"c"}
    for bad, message in (((-1.0, 5), "rate_limit_rps must be >= 0"), ((1.0, 0), "rate_limit_burst must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            RateLimits(*bad)


@pytest.fixture(scope="module")
def limited(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, rate_limit_rps=0.001, rate_limit_burst=2)
    yield p
    p.close()


def test_a_client_over_its_rate_is_refused_and_the_others_are_not(limited):
    stub = limited.coordinator_stub()
    request = cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2)
    for _ in range(2):  # the burst
        assert list(stub.Generate(request, timeout=60))[-1].finish_reason == "length"
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details().startswith("peer ipv4:127.0.0.1 is over its rate limit of 0.001 requests/s (burst 2")
    wait = dict(e.value.trailing_metadata())[RETRY_AFTER]
    assert 900.0 < float(wait) <= 1000.0  # 1000 s less the time since the burst (a loaded machine is slow)
    other = stub.Generate(request, timeout=60, metadata=((FORWARDED_FOR, "203.0.113.9"),))  # another client
    assert list(other)[-1].finish_reason == "length"


def test_the_http_api_answers_429_with_retry_after(limited):
    http = limited.loop.run(start_http(limited.addresses["coordinator"], HOST, 0))
    try:
        body = {"model": "target", "prompt": [1, 2, 3], "max_tokens": 2}
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=60) as h:
            codes = [h.post(f"http://{HOST}:{http.port}/v1/completions", json=body) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        refused = codes[2]
        assert 900 < int(refused.headers["Retry-After"]) <= 1000  # whole seconds, rounded up
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert error["message"].startswith("peer ipv4:127.0.0.3 is over its rate limit")
    finally:
        limited.loop.run(http.stop())
