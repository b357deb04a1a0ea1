"""DecodeRun on the verifier: a run of plain steps that the model thread chains itself.

    chain = RunChain(batcher, loop, RunStep(seq, token, round, keep), steps)
    chain.start()                      # step 1 queued in the batcher
    item = await chain.answers.get()   # each step's DecodeResponse (or its exception), in order
    chain.cancel()                     # the caller went away: no further step is queued

Each step is an ordinary decode call through the servicer's batcher (batched with other sequences'
calls, scheduled by the step scheduler as a Decode is). When a step's answer is known, on the model
thread, the next step is queued before the answer is handed to the event loop: the model thread never
waits for the stream or for the coordinator. A cancel stops the run after the step in progress (a step
already queued still runs; its answer is kept for a retry like every step's).

`RunAnswers` keeps the answers of a sequence's recent run steps per round: after a broken run, a
Decode or DecodeRun at any round the run computed is answered from them (no second KV row). This
module knows nothing about gRPC beyond the response it passes along.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from services.engine.batcher import Batcher
from services.engine.verifier import DecodeCall
from services.errors import CapacityExceeded, InvalidRequest

MAX_RUN_STEPS = 64  # DecodeRunRequest.steps: 1..MAX_RUN_STEPS (RunAnswers keeps as many rounds)


def check_steps(steps: int) -> None:
    if not 1 <= steps <= MAX_RUN_STEPS:
        raise InvalidRequest(f"steps must be in [1, {MAX_RUN_STEPS}]; got {steps}")


@dataclass(frozen=True, slots=True)
class RunStep(DecodeCall):
    """One step of a DecodeRun: a DecodeCall whose answer is kept per round (RunAnswers)."""


class RunAnswers:
    """Per sequence, the answers of its latest run steps by round (at most MAX_RUN_STEPS rounds).
    Written and read on the model thread only."""

    def __init__(self) -> None:
        self._rounds: dict[str, dict[int, object]] = {}

    def keep(self, seq_id: str, round_index: int, response: object) -> None:
        rounds = self._rounds.setdefault(seq_id, {})
        if rounds and round_index - 1 not in rounds:  # a new run, not the next step of the kept ones
            rounds.clear()
        rounds[round_index] = response
        if len(rounds) > MAX_RUN_STEPS:
            del rounds[min(rounds)]

    def get(self, seq_id: str, round_index: int) -> object | None:
        return self._rounds.get(seq_id, {}).get(round_index)

    def forget(self, seq_id: str) -> None:
        """The sequence moved past its run (a new Verify or Decode ran) or left."""
        self._rounds.pop(seq_id, None)


class RunChain:
    """The steps of one DecodeRun call: `answers` gets each step's response (with `.token`) or the
    exception that ended the run, in order; nothing follows an exception."""

    def __init__(self, batcher: Batcher, loop: asyncio.AbstractEventLoop, first: RunStep, steps: int,
                 observe: Callable[[float], None] = lambda s: None) -> None:
        """`observe(seconds)`: each step's wall time from queued to answered (a metric)."""
        self.batcher = batcher
        self.loop = loop
        self.first = first
        self.steps = steps
        self.observe = observe
        self.answers: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def start(self) -> None:
        """Queue the first step (on the event loop)."""
        self._submit(self.first, 0)

    def cancel(self) -> None:
        """No further step is queued (the step in progress still runs)."""
        self.cancelled = True

    def _submit(self, step: RunStep, k: int) -> None:
        """Queue step k (0-based): from the model thread (the previous step's answer) or the loop."""
        try:
            future = self.batcher.submit(step, block=False)
        except CapacityExceeded:  # a full queue: wait for a place on the event loop (never on the model thread)
            asyncio.run_coroutine_threadsafe(self._submit_later(step, k), self.loop)
            return
        except BaseException as e:  # noqa: BLE001 (the run's answer)
            self._deliver(e)
            return
        self._watch(future, step, k)

    async def _submit_later(self, step: RunStep, k: int) -> None:
        deadline = time.monotonic() + self.batcher.limits.queue_timeout_s
        while True:
            try:
                future = self.batcher.submit(step, block=False)
                break
            except CapacityExceeded as e:
                if self.cancelled or time.monotonic() >= deadline:
                    self.answers.put_nowait(e)
                    return
                await asyncio.sleep(0.002)
            except BaseException as e:  # noqa: BLE001 (the run's answer)
                self.answers.put_nowait(e)
                return
        self._watch(future, step, k)

    def _watch(self, future: Future, step: RunStep, k: int) -> None:
        t0 = time.perf_counter()

        def done(f: Future) -> None:  # on the model thread (or here, when already done)
            self.observe(time.perf_counter() - t0)
            error = f.exception()
            if error is None and k + 1 < self.steps and not self.cancelled:
                response = f.result()
                self._submit(RunStep(step.seq_id, int(response.token), step.round_index + 1,  # type: ignore[attr-defined]
                                     step.keep_features), k + 1)  # before the answer goes out
            self._deliver(error if error is not None else f.result())

        future.add_done_callback(done)

    def _deliver(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.answers.put_nowait, item)
