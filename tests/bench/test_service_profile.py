"""services/bench/service_profile.py: py-spy's raw stacks summarised per thread (a hand-written file:
which samples wait, which are active, where aerie's frames put them), and the refusal without py-spy.
The sampling itself runs against real services in tests/bench/test_pipeline_shape.py."""

import pytest

from services.bench import service_profile
from services.bench.service_profile import RATE, read_raw, summarize, where
from services.errors import InvalidRequest

RAW = """\
thread (101): verifier-batcher;_bootstrap (threading.py:995);Batcher._loop (services/engine/batcher.py:282);attend (services/model/attention.py:162) 30
thread (101): verifier-batcher;_bootstrap (threading.py:995);Batcher._loop (services/engine/batcher.py:270);Condition.wait (threading.py:327) 50
thread (102): MainThread;<module> (aerie_cli/__main__.py:4);_serve_model_service (aerie_cli/serve.py:83);Handle._run (asyncio/events.py:80) 12
thread (102): MainThread;<module> (aerie_cli/__main__.py:4);_serve_model_service (aerie_cli/serve.py:83);EpollSelector.select (selectors.py:468) 40
thread (103): Thread-1 (_poll_wrapper);Thread.run (threading.py:982) 60
"""
GIL = """\
thread (101): verifier-batcher;_bootstrap (threading.py:995);Batcher._loop (services/engine/batcher.py:282);attend (services/model/attention.py:162) 5
thread (102): MainThread;<module> (aerie_cli/__main__.py:4);_serve_model_service (aerie_cli/serve.py:83);Handle._run (asyncio/events.py:80) 10
"""


def test_threads_waits_and_places(tmp_path):
    (tmp_path / "all.raw").write_text(RAW)
    (tmp_path / "gil.raw").write_text(GIL)
    threads = read_raw(tmp_path / "all.raw")
    assert {name: (s, a) for name, (s, a, _) in threads.items()} == {
        "verifier-batcher": (80, 30), "MainThread": (52, 12), "Thread-1 (_poll_wrapper)": (60, 0)}
    s = summarize(tmp_path / "all.raw", tmp_path / "gil.raw", seconds=1.0)
    assert s["rate"] == RATE and list(s["threads"])[:2] == ["verifier-batcher", "MainThread"]  # by active samples
    batcher = s["threads"]["verifier-batcher"]
    assert (batcher["samples"], batcher["active"], batcher["gil"]) == (80, 30, 5)
    assert batcher["active_share"] == round(30 / RATE, 3) and batcher["gil_share"] == round(5 / RATE, 3)
    assert batcher["top"] == [("attend (services/model/attention.py:162) < Batcher._loop (services/engine/batcher.py:282)", 30)]
    loop = s["threads"]["MainThread"]  # the event loop's own work: the leaf, in aerie's innermost frame
    assert loop["top"] == [("Handle._run (asyncio/events.py:80) in _serve_model_service (aerie_cli/serve.py:83)", 12)]
    assert where(["f (elsewhere.py:1)"]) == "f (elsewhere.py:1)"
    assert where([f"g ({service_profile.REPO}services/x.py:2)"]) == "g (services/x.py:2)"  # absolute paths too
    assert summarize(tmp_path / "none.raw", tmp_path / "none-gil.raw", 1.0)["threads"] == {}


def test_without_py_spy_the_refusal_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(service_profile.shutil, "which", lambda name: None)
    monkeypatch.setattr(service_profile.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(InvalidRequest, match="pip install py-spy"):
        service_profile.find_py_spy()
