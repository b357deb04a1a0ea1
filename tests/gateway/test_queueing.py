"""Past --max-num-seqs a request waits for a slot (vLLM's behaviour), over real servers on loopback and
the official openai client: it counts in aerie:num_requests_waiting, is served once a slot frees, and
the queue's bounds answer 503 with Retry-After. The slot is held by the test itself (a reservation
in the coordinator's Sequences, released when the test says so): no timing decides the outcome."""

import threading

import httpx
import pytest

from tests.gateway.http_pipeline import openai_client, served_pipeline
from tests.pipeline import wait_until


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url):
    yield from served_pipeline(text_model_dirs, redis_url, max_sequences=1, coordinator_max_sequences=1,
                               max_queued_requests=1)


def waiting_gauge(base: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("aerie:num_requests_waiting{"):
            return float(line.split()[-1])
    raise AssertionError("no aerie:num_requests_waiting")


def test_a_request_past_the_limit_waits_then_is_served(served):
    p, base = served
    sequences, admission = p.coordinator.sequences, p.coordinator.servicer.admission
    assert sequences.try_reserve()  # the one slot is taken
    answers: list = []

    def request():
        try:
            answers.append(openai_client(base).completions.create(model="target", prompt=[5, 17, 9], max_tokens=4,
                                                                  temperature=0))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            answers.append(e)

    arrived = threading.Thread(target=request)
    arrived.start()
    try:
        wait_until(lambda: admission.waiting == 1 or answers)
        assert not answers, answers
        assert waiting_gauge(base) == 1
        body = {"model": "target", "prompt": [5], "max_tokens": 2}
        full = httpx.post(base + "/v1/completions", json=body, timeout=60)  # one more than the queue holds
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert "AERIE_MAX_QUEUED_REQUESTS=1" in full.json()["error"]["message"]
        assert arrived.is_alive() and not answers  # still waiting: nothing was refused
    finally:
        sequences.release_reserved()  # the slot frees: the waiting request is admitted
    arrived.join(timeout=120)
    assert answers and answers[0].usage.completion_tokens == 4
    assert admission.waiting == 0 and waiting_gauge(base) == 0


def test_a_wait_past_the_queue_timeout_is_503(served):
    p, base = served
    sequences, admission = p.coordinator.sequences, p.coordinator.servicer.admission
    timeout = admission.timeout_s
    assert sequences.try_reserve()
    admission.timeout_s = 0.05  # the slot is never freed during the wait: the outcome is the timeout
    try:
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "target", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2})
    finally:
        admission.timeout_s = timeout
        sequences.release_reserved()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "AERIE_QUEUE_TIMEOUT_S" in r.json()["error"]["message"]
    assert waiting_gauge(base) == 0
