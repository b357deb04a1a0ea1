"""`aerie serve ORG/NAME` as a vLLM user runs it: the model and its head named by Hub ids found in a
Hugging Face cache (HF_HUB_OFFLINE=1, never the network), the HTTP API on --port, the model listed
under the name typed, an API key from the environment, every internal port pinned, vLLM's
--max-model-len / --gpu-memory-utilization (no effect on the CPU) and the queue bounds passed on;
SIGTERM stops it."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.hub_cache import add_to_hub_cache
from tests.pipeline import TREE


def free_ports(n: int) -> list[int]:
    """n ports free now; with consecutive pins (BASE+i) the caller asks for a block of its own."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_serve_a_hub_id_with_pinned_ports_and_an_api_key(model_dirs, tmp_path):
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "org/tiny", model_dirs.target)
    add_to_hub_cache(cache, "org/tiny-head", model_dirs.head)
    http, grpc_port, redis, verifier, drafter, metrics = free_ports(6)
    env = {**os.environ, "AERIE_TORCH_THREADS": "1", "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "AERIE_API_KEY": "sk-test-0123456789"}
    argv = ["serve", "org/tiny", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
            "org/tiny-head", "--dtype", "auto", "--speculative-eagle-topk", str(TREE.top_k),
            "--speculative-num-steps", str(TREE.depth + 1), "--speculative-num-draft-tokens", str(TREE.size),
            "--port", str(http), "--grpc-port", str(grpc_port), "--redis-port", str(redis),
            "--verifier-port", str(verifier), "--drafter-port", str(drafter), "--metrics-port", str(metrics),
            "--max-num-seqs", "4", "--log-level", "WARNING", "--max-model-len", "200", "--gpu-memory-utilization",
            "0.9", "--max-queued-requests", "8", "--queue-timeout-s", "60"]
    stderr = tmp_path / "stderr"
    serve = subprocess.Popen([sys.executable, "-m", "aerie_cli", *argv], stdout=subprocess.PIPE, text=True, env=env,
                             stderr=stderr.open("w"))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not (lines and lines[-1].startswith("ready:")):
            line = serve.stdout.readline()
            assert line or serve.poll() is None, f"aerie serve exited with {serve.poll()}: {lines}"
            assert time.monotonic() < deadline, lines
            lines.append(line.strip())
        roles = {line.split()[0]: line for line in lines[:-1]}
        assert f"127.0.0.1:{redis}" in roles["redis"] and f"127.0.0.1:{verifier} " in roles["verifier"]
        assert f"127.0.0.1:{drafter} " in roles["drafter"] and f"127.0.0.1:{grpc_port} " in roles["coordinator"]
        assert f"metrics http://127.0.0.1:{metrics}/metrics" in roles["coordinator"]  # coordinator 0 at BASE
        assert f"metrics http://127.0.0.1:{metrics + 1}/metrics" in roles["verifier"]  # then the verifiers
        assert f"http://127.0.0.1:{http}/v1" in roles["http"]
        assert "requires the API key" in roles["security"]
        base = f"http://127.0.0.1:{http}/v1"
        auth = {"Authorization": "Bearer sk-test-0123456789"}
        assert httpx.get(f"{base}/models", timeout=30).status_code == 401
        models = httpx.get(f"{base}/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["org/tiny"]  # vLLM's default name: the model as typed
        assert models["data"][0]["max_model_len"] == 200  # --max-model-len reached the verifier
        over = httpx.post(f"{base}/completions", headers=auth, timeout=60,
                          json={"model": "org/tiny", "prompt": [5] * 10, "max_tokens": 191})
        assert over.status_code == 400 and "maximum context length is 200 tokens" in over.json()["error"]["message"]
        r = httpx.post(f"{base}/completions", headers=auth, timeout=60,
                       json={"model": "org/tiny", "prompt": [5, 17, 99, 3, 42], "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        scrape = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=30).text
        assert re.search(r"^aerie_tokens_generated_total\{.*\} 12\.0$", scrape, re.M), scrape[:2000]
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(150)  # a hang guard: each of the three stop tiers kills after 30 s (coordinator/up.py)
    assert code == 0, stderr.read_text()[-4000:]
