"""The batcher on its own (no model): calls queued during a batch form the next one, in order;
a second call of one key waits for the next batch; an exclusive function is a barrier; an error
result fails only its call; a full queue refuses after its deadline; gathering waits (bounded) for
the sequences expected to call, so they stay in one batch.

No sleeps: the worker's progress is observed through events (the recorder's `started`, the manual
clock's reads), and gathering runs on a manual clock, so every assertion holds however slow or
loaded the machine is."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.batcher import Batcher, BatchLimits
from services.errors import CapacityExceeded, InvalidRequest


class ManualClock:
    """Seconds that move only when the test says so; counts its reads (the worker's progress)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            self.reads += 1
            self._cond.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._cond:
            self.now += seconds

    def wait_reads(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.reads >= n, timeout=10), f"{self.reads} clock reads, not {n}"


class Recorder:
    """run_batch: records each batch; `started` is set once a batch runs; a closed `gate` holds it;
    with a clock, each batch takes `cost` seconds of it."""

    def __init__(self, clock: ManualClock | None = None, cost: float = 0.0) -> None:
        self.batches: list[list] = []
        self.clock, self.cost = clock, cost
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, calls: list) -> list:
        self.started.set()
        assert self.gate.wait(10)
        if self.clock is not None:
            self.clock.advance(self.cost)
        self.batches.append(list(calls))
        return [ValueError(f"bad {c}") if str(c).startswith("bad") else f"ok {c}" for c in calls]


def make(rec: Recorder, expect=None, **limits) -> Batcher:
    return Batcher("test", rec, rows=lambda c: 3 if str(c).endswith("big") else 1, key=lambda c: str(c)[:2],
                   limits=BatchLimits(**limits), expect=expect, clock=rec.clock or time.monotonic)


def test_calls_queued_during_a_batch_form_the_next_one_in_order() -> None:
    rec = Recorder()
    b = make(rec, max_batch=3, max_rows=4)
    rec.gate.clear()
    first = b.submit("z9")
    assert rec.started.wait(10)  # the worker took "z9" alone and waits at the gate
    futures = [b.submit(c) for c in ["a0", "b1", "a0x", "c2", "bad", "d3big", "e4"]]
    rec.gate.set()
    assert first.result(10) == "ok z9"
    results = []
    for f in futures:
        try:
            results.append(f.result(10))
        except ValueError as e:
            results.append(str(e))
    assert results == ["ok a0", "ok b1", "ok a0x", "ok c2", "bad bad", "ok d3big", "ok e4"]
    # a0, b1, c2 (a0x deferred: key "a0" is in the batch; max_batch 3); a0x, bad (d3big's 3 rows
    # would make 5 > max_rows 4); d3big, e4
    assert rec.batches == [["z9"], ["a0", "b1", "c2"], ["a0x", "bad"], ["d3big", "e4"]]
    b.close()


def test_exclusive_is_a_barrier() -> None:
    rec = Recorder()
    b = make(rec)
    rec.gate.clear()
    order: list[str] = []
    f1 = b.submit("a1")
    assert rec.started.wait(10)  # a1 runs (held at the gate)
    f2 = b.submit("b1")
    fx = b.exclusive(lambda: order.append(f"exclusive after {len(rec.batches)} batches"))
    f3 = b.submit("c1")
    rec.gate.set()
    for f in (f1, f2, fx, f3):
        f.result(10)
    assert order == ["exclusive after 2 batches"] and rec.batches == [["a1"], ["b1"], ["c1"]]
    b.close()


def test_a_full_queue_refuses_after_its_deadline() -> None:
    rec = Recorder()
    b = make(rec, max_queue=1, queue_timeout_s=0.2)
    rec.gate.clear()
    b.submit("a1")
    assert rec.started.wait(10)  # a1 runs (held); the queue is empty again
    b.submit("b1")  # queued: the queue is full
    t0 = time.monotonic()
    with pytest.raises(CapacityExceeded, match=r"the test batch queue is full: 1 calls .*max_queue 1, waited 0.2 s"):
        b.submit("c1")
    assert time.monotonic() - t0 >= 0.2  # a lower bound: submit() waits until its deadline has passed
    rec.gate.set()
    b.close()
    with pytest.raises(InvalidRequest, match="max_batch must be >= 1"):
        BatchLimits(max_batch=0)


def test_gathering_keeps_expected_sequences_in_one_batch_and_is_bounded() -> None:
    clock = ManualClock()
    rec = Recorder(clock, cost=0.2)
    b = make(rec, expect=lambda: 3, max_wait_s=1.0)
    b.call("w0")  # a first batch: its 0.2 s bounds the later waits to 0.1 s
    assert clock.reads == 2  # its start and end (alone, no previous batch: no gathering)
    f1 = b.submit("a1")
    clock.wait_reads(4)  # the worker gathers (deadline, then time left): a1 waits for b1 and c1
    assert not f1.done()
    f2, f3 = b.submit("b1"), b.submit("c1")  # the clock stands still: however late they come, they join
    for f in (f1, f2, f3):
        f.result(10)
    assert rec.batches[1] == ["a1", "b1", "c1"]  # waited for the two that were expected
    reads = clock.reads
    f4 = b.submit("d1")
    clock.wait_reads(reads + 2)  # gathering for d1: two expected calls never come
    assert not f4.done()
    clock.advance(0.1)  # the bound passes: d1 runs alone
    assert f4.result(10) == "ok d1"
    assert rec.batches[2] == ["d1"]
    b.close()
