"""`aerie up` as a user runs it: five real processes (Redis, verifier, drafter, coordinator and the
HTTP gateway) on loopback, `aerie generate --coordinator` against them, then SIGTERM stops everything cleanly."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from aerie_cli.main import main
from tests.pipeline import TREE


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_then_generate_then_sigterm(model_dirs, capsys):
    env = {**os.environ, "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING"}
    argv = ["--target", str(model_dirs.target), "--draft", str(model_dirs.head), "--dtype", "fp32",
            "--tree-top-k", str(TREE.top_k), "--tree-depth", str(TREE.depth), "--tree-tokens", str(TREE.size)]
    up = subprocess.Popen([sys.executable, "-m", "aerie_cli", "up", *argv, "--port", "0", "--http-port", "0"],
                          stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while not (lines and lines[-1].startswith("ready:")):
            line = up.stdout.readline()
            assert line or up.poll() is None, f"aerie up exited with {up.poll()}: {lines}"
            assert time.monotonic() < deadline, lines
            lines.append(line.strip())
        roles = {line.split()[0]: line for line in lines[:-1]}
        assert set(roles) == {"redis", "verifier", "drafter", "coordinator", "gateway", "http", "security",
                              "drafts"}, lines
        assert roles["security"].startswith("security     local mode: loopback only")
        assert roles["drafts"].startswith("drafts       direct: each verifier sends")  # aerie up's default
        address = re.search(r"--coordinator (\S+)", lines[-1]).group(1)
        pids = [int(p) for p in re.findall(r"pid (\d+)", "\n".join(lines))]
        pids = sorted(set(pids))  # the http line names the gateway's pid again
        assert len(pids) == 5 and all(alive(p) for p in pids)
        assert all("metrics http://127.0.0.1:" in roles[r] for r in ("verifier", "drafter", "coordinator"))
        # Redis has a generated password, printed nowhere and on no command line (docs/security.md)
        password_file = re.search(r"password in (\S+), mode 0600", roles["redis"]).group(1)
        password = open(password_file).read().strip()
        assert "redis://:***@127.0.0.1:" in roles["redis"] and password not in "\n".join(lines)
        assert password not in subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout

        gen = ["generate", "--target", str(model_dirs.target), "--prompt-ids", "5,17,99,3,42",
               "--max-new-tokens", "30", "--json"]
        assert main([*gen, "--coordinator", address]) == 0  # the model flags were given to `aerie up`
        remote = json.loads(capsys.readouterr().out)
        assert main([*gen, *argv[2:]]) == 0
        local = json.loads(capsys.readouterr().out)
        assert remote["tokens"] == local["tokens"] and remote["accept_lengths"] == local["accept_lengths"]
        assert remote["tree"] == local["tree"] and remote["draft"] == model_dirs.head.name  # names, no paths
        # the OpenAI-compatible HTTP API `aerie up` prints (no tokenizer here: token-id prompts)
        http = re.search(r"(http://\S+/v1)", roles["http"]).group(1)
        r = httpx.post(f"{http}/completions", json={"model": "target", "prompt": [5, 17, 99, 3, 42],
                                                   "max_tokens": 30, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 30, "total_tokens": 35}
        assert httpx.get(http.removesuffix("/v1") + "/health", timeout=30).status_code == 200
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0
    assert not any(alive(p) for p in pids), "aerie up left a service running"
