"""An HTTP stream outlives its coordinator (gateway/resume.py): the gateway runs as a process of its
own (`aerie gateway --coordinators A,B`) in front of two coordinator processes; kill -9 of the
coordinator an SSE stream is on, and the stream goes on through Resume on the other one, with
exactly the text and the log-probabilities of an undisturbed answer and no error event.

The in-process verifier holds the rounds after the fourth until the kill has happened, so the kill
lands mid-stream whatever the speed of the machine (an order of events, not a timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest

from services.engine.verifier import DecodeCall, VerifyCall
from tests.coordinator.test_client_resume import Coordinators
from tests.pipeline import HOST, start_pipeline, wait_until

RAW = {"skip_special_tokens": False}  # the tiny vocabulary: text equality is token equality
BODY = {"prompt": [5, 17, 99, 3, 42, 8], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "logprobs": 1,
        **RAW}


@pytest.fixture(scope="module")
def pipeline(text_model_dirs, redis_url):
    p = start_pipeline(text_model_dirs, redis_url, lease_ttl_s=0.6, draft_dtype="fp32")
    yield p
    p.close()


@pytest.fixture(scope="module")
def gateway(pipeline, redis_url, tmp_path_factory):
    """Two coordinator processes and `aerie gateway --coordinators A,B` (a process too)."""
    root = tmp_path_factory.mktemp("coordinators")
    procs = Coordinators(pipeline, redis_url, root)
    gw = None
    try:
        first, second = procs.start(2)
        port_file = root / "gateway.json"
        gw = subprocess.Popen([sys.executable, "-m", "aerie_cli", "gateway", "--coordinators", f"{first},{second}",
                               "--host", HOST, "--http-port", "0", "--port-file", str(port_file)],
                              env={**os.environ, "AERIE_LOG_LEVEL": "WARNING"})
        wait_until(lambda: port_file.exists() or gw.poll() is not None, timeout=120)
        assert gw.poll() is None, f"aerie gateway exited with {gw.returncode}"
        url = f"http://{HOST}:{json.loads(port_file.read_text())['http_port']}"
        # ready: a coordinator answers GetInfo (its first one loads the tokenizer, which may take a while)
        wait_until(lambda: _health(url) == 200, timeout=120)
        yield procs, first, url
    finally:
        if gw is not None:
            gw.terminate()
            assert gw.wait(30) == 0  # SIGTERM: a clean stop
        procs.close()


def test_an_http_stream_continues_after_its_coordinator_is_killed(pipeline, gateway):
    procs, first, url = gateway
    with httpx.Client(timeout=120) as client:
        undisturbed = client.post(f"{url}/v1/completions", json=BODY).json()
        assert "choices" in undisturbed, undisturbed
        expected = undisturbed["choices"][0]["text"]
        assert undisturbed["usage"]["completion_tokens"] == 120

        engine = pipeline.verifier.verifier
        run, killed = engine.run, threading.Event()

        def held(calls):  # rounds after the fourth wait for the kill
            if any(isinstance(c, (VerifyCall, DecodeCall)) and c.round_index > 4 for c in calls):
                wait_until(killed.is_set, timeout=60)
            return run(calls)

        engine.run = held
        text, reasons, errors, logprobs = [], [], [], []
        try:
            with client.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True}) as r:
                assert r.status_code == 200
                for event in _events(r):
                    if "error" in event:
                        errors.append(event)
                        continue
                    choice = event["choices"][0]
                    text.append(choice["text"])
                    reasons.append(choice["finish_reason"])
                    logprobs += (choice["logprobs"] or {}).get("token_logprobs", [])
                    if not killed.is_set() and "".join(text).strip():
                        procs[first].kill()  # kill -9 of the coordinator the stream is on
                        procs[first].wait(30)
                        killed.set()
        finally:
            killed.set()
            engine.run = run
    assert errors == []
    assert "".join(text) == expected  # no gap, no duplicate
    assert reasons[-1] == "length"
    # the log-probabilities too, after the break (stored in Redis; the adopter's rebuilt KV: fp32 rounding)
    assert logprobs == pytest.approx(undisturbed["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


def _events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.HTTPError:
        return 0
