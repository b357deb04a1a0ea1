"""`aerie up --tp 2` as a user runs it: the verifier is a tensor-parallel group (rank 0 serves, rank 1
is its child `services.dist.worker` process), and `aerie generate --coordinator` streams exactly the
in-process TP=1 tokens."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from aerie_cli.main import main
from tests.pipeline import TREE


def children(pid: int) -> list[str]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_up_tp2_serves_the_tp1_tokens(model_dirs, capsys):
    env = {**os.environ, "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING"}
    argv = ["--target", str(model_dirs.target), "--draft", str(model_dirs.head), "--dtype", "fp32",
            "--tree-top-k", str(TREE.top_k), "--tree-depth", str(TREE.depth), "--tree-tokens", str(TREE.size)]
    up = subprocess.Popen([sys.executable, "-m", "aerie_cli", "up", *argv, "--tp", "2", "--port", "0",
                           "--http-port", "0"], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 240
        while not (lines and lines[-1].startswith("ready:")):
            line = up.stdout.readline()
            assert line or up.poll() is None, f"aerie up exited with {up.poll()}: {lines}"
            assert time.monotonic() < deadline, lines
            lines.append(line.strip())
        verifier = next(line for line in lines if line.startswith("verifier"))
        verifier_pid = int(re.search(r"pid (\d+)", verifier).group(1))
        assert any("services.dist.worker" in c and "--rank 1" in c for c in children(verifier_pid))
        address = re.search(r"--coordinator (\S+)", lines[-1]).group(1)
        gen = ["generate", "--target", str(model_dirs.target), "--prompt-ids", "5,17,99,3,42",
               "--max-new-tokens", "24", "--json"]
        assert main([*gen, "--coordinator", address]) == 0
        remote = json.loads(capsys.readouterr().out)
        assert main([*gen, *argv[2:]]) == 0
        local = json.loads(capsys.readouterr().out)
        assert remote["tokens"] == local["tokens"] and remote["accept_lengths"] == local["accept_lengths"]
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
    assert up.returncode == 0
