"""Start `aerie up` as a child process and wait for its "ready:" line (the measurement scripts)."""

from __future__ import annotations

import re
import subprocess
import sys


def start_up(argv: list[str], env: dict[str, str], lines: list[str] | None = None, python: str = sys.executable,
             cwd: str | None = None) -> subprocess.Popen:
    """`python -m aerie_cli up *argv` with `env`; returns once it printed "ready:" (SystemExit if it
    exits first). `lines`: gets the lines printed until then (addresses, pids, metrics URLs);
    `python`, `cwd`: another checkout's interpreter and directory (an A/B against its code)."""
    up = subprocess.Popen([python, "-m", "aerie_cli", "up", *argv], stdout=subprocess.PIPE, text=True,
                          env=env, cwd=cwd)
    while True:
        line = up.stdout.readline()
        if not line and up.poll() is not None:
            raise SystemExit(f"aerie up exited with {up.returncode}")
        if lines is not None:
            lines.append(line.rstrip("\n"))
        if line.startswith("ready:"):
            return up


def coordinator_address(lines: list[str]) -> str:
    """The coordinator's HOST:PORT from the lines `start_up` collected."""
    return next(m.group(1) for line in lines if (m := re.match(r"^coordinator\s+(\S+) \(pid", line)))


def stop_all(ups) -> None:
    """Stop every `aerie up` of `ups` (a dict of start_up's processes) and wait for each."""
    for up in ups.values():
        up.terminate()
        up.wait(60)
