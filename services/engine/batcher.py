"""Continuous batching: calls that arrive while a forward runs are gathered into the next forward.

    b = Batcher("verifier", run_batch, rows=lambda c: c.rows, key=lambda c: c.seq_id,
                limits=BatchLimits(max_batch=16, max_rows=512, max_queue=256, queue_timeout_s=5.0))
    result = b.call(call)                    # from any thread: blocks until its batch ran
    result = await b.call_async(call)        # from an asyncio task
    b.exclusive(fn, *args)                   # run fn alone on the worker, between batches (release...)

One worker thread owns the model. Each step (one forward) serves the calls queued before the first
exclusive function, as services/engine/step_scheduler.py picks them: every decode/verify call first
(arrival order, up to `max_batch` calls and `max_rows` rows), then Prefill chunks while the step stays
within the token budget (`step_rows`, fixed, or `budget`, learned from the steps that ran:
services/engine/step_cost.py; a call larger than `max_rows` runs alone), and hands them to `run_batch`
as one list: one forward. Calls queued during that forward form the next batch. The budget applies while
a sequence decodes here (`decoding`); then a prefill call that does not fit is cut (`split`): its first
rows run in this step, the rest keeps its place in the queue and its caller's future, which gets the
last slice's result (a slice that fails fails the call; a call whose first slice ran can no longer be
cancelled). Gathering: when fewer calls wait than sequences hold state here (`expect`), the worker waits
for the missing ones, at most min(max_wait_s, half the last forward's time), so that sequences whose
calls come back after a round trip elsewhere stay in one batch instead of taking turns; alone (one
sequence) it never waits. A second call of the same key (sequence) waits for the next batch, so a batch
never holds one sequence twice. An exclusive function is a barrier: the calls before it run first, the
calls after it after.

`run_batch(calls)` returns one result per call, in order; a result that is an exception is raised
to that call only, so one bad request never fails its neighbours. If `run_batch` itself raises,
every call of that batch gets the error.

Bounded admission: at most `max_queue` calls wait; a call arriving at a full queue waits up to
`queue_timeout_s` for a place, then gets CapacityExceeded (RESOURCE_EXHAUSTED at the gRPC edge),
naming the limit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from services.engine.step_scheduler import STARVE_STEPS, Queued, plan
from services.errors import CapacityExceeded, InvalidRequest

if TYPE_CHECKING:
    from services.engine.step_cost import StepBudget

C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch: int = 16  # calls per forward
    max_rows: int = 1024  # rows (prompt tokens, tree nodes, decode tokens) per forward
    max_queue: int = 256  # calls waiting for a forward
    queue_timeout_s: float = 5.0  # how long a call waits for a place in a full queue
    max_wait_s: float = 0.05  # gathering: how long a batch may wait for the sequences expected to call

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_rows", "max_queue"):
            if getattr(self, name) < 1:
                raise InvalidRequest(f"{name} must be >= 1; got {getattr(self, name)}")
        if not self.queue_timeout_s >= 0:
            raise InvalidRequest(f"queue_timeout_s must be >= 0; got {self.queue_timeout_s}")
        if not self.max_wait_s >= 0:
            raise InvalidRequest(f"max_wait_s must be >= 0; got {self.max_wait_s}")


@dataclass(eq=False)  # identity: the queue removes items by identity
class _Item:
    future: Future
    call: Any = None
    fn: Callable | None = None  # an exclusive function (call unused)
    args: tuple = ()
    owner: _Item | None = None  # a slice: the queued call it was cut from (its failure fails the owner)
    running: bool = False  # the future is set running (a call whose first slice ran)


@dataclass(frozen=True, slots=True)
class BatchStats:
    size: int  # calls in the batch
    rows: int  # rows of the forward
    waiting: int  # calls still queued when it started
    seconds: float  # run_batch wall time


class Batcher(Generic[C]):
    def __init__(self, name: str, run_batch: Callable[[list[C]], list[Any]], rows: Callable[[C], int],
                 key: Callable[[C], Hashable], limits: BatchLimits = BatchLimits(),
                 on_batch: Callable[[BatchStats], None] | None = None,
                 expect: Callable[[], int] | None = None, clock: Callable[[], float] = time.monotonic,
                 prefill: Callable[[C], bool] | None = None, step_rows: int | None = None,
                 split: Callable[[C, int], tuple[C, C]] | None = None,
                 splittable: Callable[[C], bool] | None = None,
                 decoding: Callable[[], int] | None = None, budget: StepBudget | None = None,
                 prefix: Callable[[C], int] | None = None) -> None:
        """`expect`: how many calls the next batch could hold (the sequences holding state here);
        None = never wait for more calls. `prefill`: whether a call is a Prefill chunk (None = none
        is); `step_rows`: the token budget of one step (services/engine/step_scheduler.py; None =
        `max_rows` only). `split(call, rows)`: (its first `rows` rows, the rest), for the calls
        `splittable(call)` allows (None: no call is cut). `decoding`: how many sequences decode here;
        the budget applies only while one does (None: always). `budget`: a budget learned from the
        steps that ran (services/engine/step_cost.py), used instead of `step_rows` when given: asked
        for each step's rows, told each step's calls and run time; `prefix(call)`: the rows its
        sequence holds in KV before it (None: 0), what the budget's attention term reads. `clock`:
        seconds, for a batch's run time and the gathering deadline (tests pass a manual clock, so what
        they assert does not follow the machine's speed); the queue's admission deadline is always
        real time."""
        self.name = name
        self.limits = limits
        self._expect = expect
        self._clock = clock
        self._last_s = 0.0  # the last batch's run time
        self._run_batch, self._rows, self._key, self._on_batch = run_batch, rows, key, on_batch
        self._prefill = prefill or (lambda call: False)
        self.step_rows = step_rows
        self._split, self._splittable, self._decoding = split, splittable, decoding
        self.budget = budget
        self._prefix = prefix or (lambda call: 0)
        self._ran: list[Queued] = []  # the calls of the step being run, for `budget.observe`
        self._passed_over = 0  # steps in a row that ran no prefill while one waited
        self._queue: deque[_Item] = deque()
        self._calls_waiting = 0
        self._cond = threading.Condition()
        self._closed = False
        self.largest_batch = 0  # the most calls one forward served so far
        self.batches = 0  # forwards run so far
        self._thread = threading.Thread(target=self._loop, name=f"{name}-batcher", daemon=True)
        self._thread.start()

    # ---- submitting ----------------------------------------------------------------------------------

    def submit(self, call: C, block: bool = True) -> Future:
        """Queue `call`; the future gets its result. A full queue: wait up to queue_timeout_s
        (`block`), else CapacityExceeded."""
        deadline = time.monotonic() + self.limits.queue_timeout_s
        with self._cond:
            while self._calls_waiting >= self.limits.max_queue and not self._closed:
                left = deadline - time.monotonic()
                if not block or left <= 0:
                    raise self._full()
                self._cond.wait(left)
            return self._put(_Item(Future(), call))

    def call(self, call: C) -> Any:
        """Submit and wait (any thread but the worker)."""
        return self.submit(call).result()

    async def call_async(self, call: C) -> Any:
        """Submit and await, without blocking the event loop (a full queue is polled until its
        deadline)."""
        deadline = time.monotonic() + self.limits.queue_timeout_s
        while True:
            try:
                future = self.submit(call, block=False)
                break
            except CapacityExceeded:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.002)
        return await asyncio.wrap_future(future)

    def exclusive(self, fn: Callable, *args) -> Future:
        """Run fn(*args) alone on the worker thread, after every call queued before it."""
        with self._cond:
            return self._put(_Item(Future(), fn=fn, args=args))

    async def exclusive_async(self, fn: Callable, *args) -> Any:
        return await asyncio.wrap_future(self.exclusive(fn, *args))

    def run(self, fn: Callable, *args) -> Any:
        """exclusive() and wait for its result (from a thread that is not the worker)."""
        return self.exclusive(fn, *args).result()

    @property
    def waiting(self) -> int:
        return self._calls_waiting

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _put(self, item: _Item) -> Future:
        if self._closed:
            raise CapacityExceeded(f"the {self.name} batcher is shut down")
        self._queue.append(item)
        if item.fn is None:
            self._calls_waiting += 1
        self._cond.notify_all()
        return item.future

    def _full(self) -> CapacityExceeded:
        return CapacityExceeded(
            f"the {self.name} batch queue is full: {self._calls_waiting} calls wait for a forward "
            f"(max_queue {self.limits.max_queue}, waited {self.limits.queue_timeout_s:g} s)")

    # ---- the worker ----------------------------------------------------------------------------------

    def _take(self) -> list[_Item] | None:
        """The next batch (or one exclusive item); None once closed and drained."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            if self._queue[0].fn is None and self._expect is not None:
                self._gather()
            if self._queue[0].fn is not None:
                return [self._queue.popleft()]
            head: list[_Item] = []  # the calls before the first barrier
            for item in self._queue:
                if item.fn is not None:
                    break
                head.append(item)
            queued = [Queued(self._rows(i.call), self._prefill(i.call), self._key(i.call),
                             self._split is not None and self._prefill(i.call)
                             and (self._splittable is None or self._splittable(i.call)),
                             self._prefix(i.call) if self.budget is not None else 0) for i in head]
            budget = self.step_rows if self.budget is None else self.budget.rows(queued)
            if budget is not None and self._decoding is not None and self._decoding() == 0 \
                    and all(q.prefill for q in queued):
                budget = None  # no sequence decodes here: a prompt alone runs whole chunks
            step = plan(queued, self.limits.max_batch, self.limits.max_rows, budget,
                        starved=self._passed_over >= STARVE_STEPS)
            batch = [head[i] for i in step.picked]
            waiting_prefill = any(q.prefill for q in queued)
            ran_prefill = any(queued[i].prefill for i in step.picked)
            self._passed_over = 0 if ran_prefill or not waiting_prefill else self._passed_over + 1
            if step.cut is not None:
                batch = self._cut(batch, head[step.cut[0]], step.cut[1])
            if self.budget is not None:  # what this step runs (a slice: its own rows), before it runs
                self._ran = [Queued(self._rows(i.call), self._prefill(i.call), self._key(i.call),
                                    prefix=self._prefix(i.call)) for i in batch]
            taken = {id(i) for i in batch if i.owner is None}
            self._queue = deque(i for i in self._queue if id(i) not in taken)
            self._calls_waiting -= len(taken)
            self._cond.notify_all()  # places freed in the queue
            return batch

    def _cut(self, batch: list[_Item], owner: _Item, rows: int) -> list[_Item]:
        """`batch` with `owner` replaced by a slice of its first `rows` rows; the rest stays queued
        in the owner's place (lock held). A call cancelled before its first slice is dropped."""
        if not owner.running:
            if not owner.future.set_running_or_notify_cancel():
                self._queue.remove(owner)
                self._calls_waiting -= 1
                return [i for i in batch if i is not owner]
            owner.running = True
        first, owner.call = self._split(owner.call, rows)  # type: ignore[misc]
        return [_Item(Future(), first, owner=owner) if i is owner else i for i in batch]

    def _gather(self) -> None:
        """Wait (lock held) until every sequence expected to call has a call queued, an exclusive
        function is queued, or min(max_wait_s, half the last batch's run time) has passed.
        Sequences driven from elsewhere (a coordinator's round trip between two calls) would
        otherwise fall out of step, each forward serving one of them in turn."""
        expect = self._expect
        assert expect is not None  # _take gathers only with an `expect`
        limit = min(self.limits.max_wait_s, 0.5 * self._last_s)
        if limit <= 0:
            return
        deadline = self._clock() + limit
        while not self._closed:
            target = min(expect(), self.limits.max_batch)
            if self._calls_waiting >= target or any(i.fn is not None for i in self._queue):
                return
            left = deadline - self._clock()
            if left <= 0:
                return
            self._cond.wait(left)

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            live = [item for item in batch if item.running or item.future.set_running_or_notify_cancel()]
            if not live:
                continue
            fn = live[0].fn
            if fn is not None:
                item = live[0]
                try:
                    item.future.set_result(fn(*item.args))
                except BaseException as e:  # noqa: BLE001 (handed to the caller)
                    item.future.set_exception(e)
                continue
            t0 = self._clock()
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(live))
            try:
                results = self._run_batch([item.call for item in live])
                assert len(results) == len(live), (len(results), len(live))
            except BaseException as e:  # noqa: BLE001 (every call of the batch gets it)
                for item in live:
                    item.future.set_exception(e)
                    if item.owner is not None:
                        self._drop(item.owner, e)
                continue
            self._last_s = self._clock() - t0
            if self.budget is not None:
                try:
                    self.budget.observe(self._ran, self._last_s)
                except Exception:  # noqa: BLE001 (a budget that fails to learn never withholds the results)
                    pass
            if self._on_batch is not None:  # before the results: a caller that reads the metrics after
                #                             its call returns sees its batch counted
                try:
                    self._on_batch(BatchStats(len(live), sum(self._rows(i.call) for i in live), self._calls_waiting,
                                              self._last_s))
                except Exception:  # noqa: BLE001 (a metrics hook never withholds the results)
                    pass
            for item, result in zip(live, results, strict=True):
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                    if item.owner is not None:
                        self._drop(item.owner, result)
                else:
                    item.future.set_result(result)

    def _drop(self, owner: _Item, error: BaseException) -> None:
        """A slice failed: its owner (the rest, still queued) fails with the same error."""
        with self._cond:
            if owner in self._queue:
                self._queue.remove(owner)
                self._calls_waiting -= 1
                self._cond.notify_all()
        owner.future.set_exception(error)
