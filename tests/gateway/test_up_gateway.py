"""`aerie up --coordinators 2` runs the HTTP API as a process of its own (`aerie gateway` in front of
both coordinators): kill -9 of the coordinator an SSE stream is on, and the stream goes on through the
other one with exactly the text of an undisturbed answer and no error event.

Mid-stream by an order of events, not a timing: once the first tokens have arrived the verifier is
stopped (SIGSTOP: no round can finish), the coordinator is killed, then the verifier continues
(SIGCONT); tokens that arrive after the kill show the stream outlived it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.pipeline import TREE

RAW = {"skip_special_tokens": False}  # the tiny vocabulary: text equality is token equality
BODY = {"prompt": [5, 17, 99, 3, 42, 8], "max_tokens": 300, "temperature": 0, "ignore_eos": True, **RAW}


def start_up(model_dirs, tmp_path, *extra: str):
    env = {**os.environ, "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING", "AERIE_LEASE_TTL_S": "1",
           "AERIE_HEARTBEAT_S": "0.5", "AERIE_HEARTBEAT_TTL_S": "2", "AERIE_PROBE_INTERVAL_S": "0.5"}
    state = tmp_path / "state.json"
    argv = ["--target", str(model_dirs.target), "--draft", str(model_dirs.head), "--dtype", "fp32",
            "--draft-dtype", "fp32", "--tree-top-k", str(TREE.top_k), "--tree-depth", str(TREE.depth),
            "--tree-tokens", str(TREE.size), "--port", "0", "--http-port", "0", "--coordinators", "2",
            "--state-file", str(state), *extra]
    up = subprocess.Popen([sys.executable, "-m", "aerie_cli", "up", *argv], stdout=subprocess.PIPE, text=True,
                          env=env)
    deadline = time.monotonic() + 240
    lines: list[str] = []
    while not (lines and lines[-1].startswith("ready:")):
        line = up.stdout.readline()
        assert line or up.poll() is None, f"aerie up exited with {up.poll()}: {lines}"
        assert time.monotonic() < deadline, lines
        lines.append(line.strip())
    return up, lines, {p["role"] + str(i): p for role in ("coordinator", "verifier", "gateway")
                for i, p in enumerate(q for q in json.loads(state.read_text())["processes"] if q["role"] == role)}


def test_an_http_stream_through_aerie_up_survives_its_coordinator(text_model_dirs, tmp_path):
    up, _, procs = start_up(text_model_dirs, tmp_path)
    try:
        url = f"http://{procs['gateway0']['address']}"
        assert procs["coordinator0"]["address"] != procs["gateway0"]["address"]  # not inside a coordinator
        with httpx.Client(timeout=240) as client:
            undisturbed = client.post(f"{url}/v1/completions", json=BODY).json()
            assert "choices" in undisturbed, undisturbed
            expected = undisturbed["choices"][0]["text"]
            verifier = procs["verifier0"]["pid"]
            text, reasons, errors, after_kill = [], [], [], 0
            killed = False
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
                        after_kill += killed
                        if not killed and "".join(text).strip():
                            os.kill(verifier, signal.SIGSTOP)  # no round finishes until SIGCONT
                            assert reasons[-1] is None  # the stream is not over
                            # the gateway sends new requests to the first coordinator
                            os.kill(procs["coordinator0"]["pid"], signal.SIGKILL)
                            killed = True
                            os.kill(verifier, signal.SIGCONT)
            finally:
                os.kill(verifier, signal.SIGCONT)
        assert killed and after_kill > 0  # tokens arrived after the kill: the stream outlived its coordinator
        assert errors == []
        assert "".join(text) == expected  # no gap, no duplicate
        assert reasons[-1] == "length"
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def test_gateway_coordinator_keeps_the_api_inside_the_first_coordinator(text_model_dirs, tmp_path):
    """`--gateway coordinator`: no gateway process; the HTTP API answers from the first coordinator."""
    up, lines, procs = start_up(text_model_dirs, tmp_path, "--gateway", "coordinator")
    try:
        assert "gateway0" not in procs
        [http] = [line for line in lines if line.startswith("http ")]
        assert "inside the first coordinator" in http
        url = http.split()[1].removesuffix("/v1")
        # /health follows the pools' heartbeats (2 s here, for the take-over test): on a loaded machine
        # a late one can make it 503 for a moment, so wait for 200 rather than catch one instant
        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{url}/health", timeout=60)).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/completions", json={**BODY, "max_tokens": 5}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0


def test_the_gateway_process_takes_the_api_key(text_model_dirs, tmp_path):
    """`aerie up --api-key`: the gateway refuses a caller without the key (401), serves one with it,
    and answers /health with its own token (identity `gateway`, generated per run)."""
    key = "sk-up-gateway-0123456789"
    up, _, procs = start_up(text_model_dirs, tmp_path, "--api-key", key)
    try:
        url = f"http://{procs['gateway0']['address']}"
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        body = {**BODY, "max_tokens": 5}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0


def _events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
