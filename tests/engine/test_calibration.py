"""Calibration: the cost cache on disk (per key, recalibrated on request), real forwards timed, the
timing's defences against a load burst, and a head's cost key naming its shape."""

import pytest

from services.engine import calibration as C


def test_costs_are_cached_per_key_and_recalibrated_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_COST_DIR", str(tmp_path / "costs"))
    monkeypatch.delenv("AERIE_RECALIBRATE", raising=False)
    calls = []

    def measure():
        calls.append(1)
        return {"n": len(calls)}

    assert C.cached("k1", measure) == {"n": 1}
    assert C.cached("k1", measure) == {"n": 1}
    assert C.cached("k2", measure) == {"n": 2}
    assert C.cached("k1", measure, recalibrate=True) == {"n": 3}
    monkeypatch.setenv("AERIE_RECALIBRATE", "1")
    assert C.cached("k1", measure) == {"n": 4}


def test_calibration_measures_real_forwards(llama_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_COST_DIR", str(tmp_path / "costs"))
    _, target, head = llama_pair
    verify = C.target_costs(target, "tiny")
    layer, proj = C.head_costs(head, "tiny")
    assert verify.rows == C.VERIFY_ROWS and all(s > 0 for s in verify.seconds)
    assert layer.rows == C.HEAD_ROWS and all(s > 0 for s in proj.seconds)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


class FakeTime:
    """time_calls' clock: the timed function advances it (`spend`) instead of sleeping, so the curve
    is exact whatever the machine's load (real sleeps of 1-4 ms were measured before)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def fake_clock(monkeypatch) -> FakeTime:
    clock = FakeTime()
    monkeypatch.setitem(C.time_calls.__globals__, "time", clock)  # the `time` time_calls reads
    return clock


def test_time_calls_interleaves_repeats_so_a_load_burst_does_not_step_the_curve(monkeypatch):
    """A burst (another process) slows 6 consecutive calls: timed one row count after another,
    all of row 2's calls would fall in it (t(2) >= 20 ms); interleaved, each row keeps clean repeats."""
    clock = fake_clock(monkeypatch)
    base, calls = {1: 0.0, 2: 0.001, 4: 0.002}, [0]

    def fn(r):
        clock.spend(base[r] + (0.02 if 6 <= calls[0] < 12 else 0.0))
        calls[0] += 1

    curve = C.time_calls(fn, (1, 2, 4), repeats=5)
    assert calls[0] == 3 * 6
    assert curve.seconds == pytest.approx((0.0, 0.001, 0.002))


def test_time_calls_takes_the_fastest_and_is_made_non_decreasing(monkeypatch):
    clock = fake_clock(monkeypatch)
    delays = {1: [0.0] * 6, 2: [0.004] * 5 + [0.02], 4: [0.001] * 6}
    curve = C.time_calls(lambda r: clock.spend(delays[r].pop()), (1, 2, 4), repeats=5)
    assert curve.seconds == pytest.approx((0.0, 0.004, 0.004))  # t(4) = 1 ms raised to t(2)


def test_a_head_replaced_in_place_by_another_shape_gets_its_own_calibration(tmp_path, llama_pair, eagle3_pair):
    """The head's cost key names its shape (config and weight-file sizes), not only its path: the
    default head's directory held an EAGLE-2 head and now holds an EAGLE-3 one."""
    import shutil

    from services.engine.local import checkpoint_shape_id
    from services.model.head_checkpoint import save_head

    save_head(llama_pair[2], tmp_path / "a")
    save_head(eagle3_pair[2], tmp_path / "b")
    before = checkpoint_shape_id(tmp_path / "a")
    (tmp_path / "a" / "report.json").write_text('{"top1_agreement": 0.5}')
    assert checkpoint_shape_id(tmp_path / "a") == before  # a report does not change the cost
    shutil.rmtree(tmp_path / "a")
    shutil.copytree(tmp_path / "b", tmp_path / "a")
    assert checkpoint_shape_id(tmp_path / "a") != before
    assert checkpoint_shape_id(tmp_path / "a") == checkpoint_shape_id(tmp_path / "b")
