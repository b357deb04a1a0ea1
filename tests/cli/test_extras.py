"""Optional extras are named when missing: `aerie up` without a redis-server names the `local` extra,
`aerie bench --chart` without matplotlib names the `bench` extra (before any model loads)."""

import importlib.util
import signal

import pytest

from aerie_cli.main import main
from coordinator import redis_server
from services.rpc.config import ConfigError


def test_missing_redis_server_names_the_local_extra(monkeypatch):
    monkeypatch.setattr(redis_server.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install 'aerie\[local\]'.*--redis-url"):
        redis_server.redis_server_binary()


def test_aerie_up_without_redis_server_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(redis_server.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["up", "--port", "0", "--startup-timeout-s", "5"]) == 2
    finally:
        for sig, handler in handlers.items():  # `aerie up` installs its own
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert "aerie: error: no redis-server binary" in err and "aerie[local]" in err


def test_bench_chart_without_matplotlib_names_the_bench_extra(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code = main(["bench", "--prompts", str(tmp_path / "none.jsonl"), "--chart", str(tmp_path / "c.png")])
    assert code == 2 and "--chart needs matplotlib: pip install 'aerie[bench]'" in capsys.readouterr().err
