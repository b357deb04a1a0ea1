"""DecodeRun on the verifier: a run of plain steps that the model thread chains itself.

    chain = RunChain(batcher, loop, RunStep(seq, token, round, keep), steps)
    chain.start()                      # step 1 queued in the batcher
    item = await chain.next_answer()   # each step's DecodeResponse (or its exception), in order
    chain.cancel()                     # the caller went away: no further step is queued

Each step is an ordinary decode call through the servicer's batcher (batched with other sequences'
calls, scheduled by the step scheduler as a Decode is). When a step's answer is known, on the model
thread, the next step is queued before the answer is handed to the event loop: the model thread never
waits for the stream or for the coordinator. A cancel stops the run after the step in progress (a step
already queued still runs; its answer is kept for a retry like every step's).

Queued steps (`RunStep.on_device`: a greedy sequence without a penalty or logprobs on a local runner,
where the servicer queues runs: on a GPU): a step's token stays on the device (a `QueuedToken`), the
next step is queued with it as its input before anything is read, and the token is read off the model
thread (`QueuedToken.response`, which waits for its own step's copy only, not for the steps queued
after it): the model thread launches step k + 1 while the device still computes step k, as the
in-process runs do (services/engine/plain_run.py).

`RunAnswers` keeps the answers of a sequence's recent run steps per round: after a broken run, a
Decode or DecodeRun at any round the run computed is answered from them (no second KV row). This
module knows nothing about gRPC beyond the response it passes along.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from services.engine.batcher import Batcher
from services.engine.verifier import DecodeCall
from services.errors import CapacityExceeded, InvalidRequest
from services.model.transfer import mark, to_host_queued

MAX_RUN_STEPS = 64  # DecodeRunRequest.steps: 1..MAX_RUN_STEPS (RunAnswers keeps as many rounds)


def check_steps(steps: int) -> None:
    if not 1 <= steps <= MAX_RUN_STEPS:
        raise InvalidRequest(f"steps must be in [1, {MAX_RUN_STEPS}]; got {steps}")


@dataclass(frozen=True, slots=True)
class RunStep(DecodeCall):
    """One step of a DecodeRun: a DecodeCall whose answer is kept per round (RunAnswers); with
    `on_device`, a QueuedToken."""


class QueuedAnswer:
    """A run step's answer whose values are still on their way from the device: `response()` waits
    for them (not for the steps queued after this one) and builds the response, once (any thread; a
    replay too). QueuedToken: a plain step's token; a tree round's next tree: verifier_svc/device_round.py."""

    def __init__(self) -> None:
        self._response: object | None = None
        self._lock = threading.Lock()
        self.started = 0.0  # perf_counter when the chain submitted the step (its latency metric)

    def response(self) -> object:
        with self._lock:
            if self._response is None:
                self._response = self._resolve()
        return self._response

    def _resolve(self) -> object:
        raise NotImplementedError

    def followed(self, queued: bool) -> None:
        """The chain's word, on the model thread, once it knows: `queued` whether a next step was
        queued after this one (a QueuedVerify then lets the model thread build it: device_round.py)."""

    def wait_turn(self) -> None:
        """Before a thread other than the model thread calls `response()` (RunChain.next_answer)."""


class QueuedToken(QueuedAnswer):
    """A queued plain step's answer: `token` [1] long on the device (the next step's input), and its
    copy to the host queued behind the step; the response is `build(token)`."""

    def __init__(self, token: torch.Tensor, build: Callable[[int], object]) -> None:
        super().__init__()
        self.token = token
        self._host = to_host_queued(token)
        self._copied = mark(token.device)
        self._build = build

    def _resolve(self) -> object:
        if self._copied is not None:
            self._copied.synchronize()
        return self._build(int(self._host[0]))


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


END = object()  # RunChain.next_answer: the run ended before its `steps` (`follow` returned None)


def next_decode(step: RunStep, response: object) -> RunStep:
    """A DecodeRun's next step: the same sequence at the next round, fed the step's token."""
    token = response.token if isinstance(response, QueuedToken) else int(response.token)  # type: ignore[attr-defined]
    return RunStep(step.seq_id, token, step.round_index + 1, step.keep_features, on_device=step.on_device)


class RunChain:
    """The steps of one DecodeRun (or VerifyRun) call: `answers` gets each step's response (with
    `.token`; or a QueuedAnswer: `next_answer` reads it) or the exception that ended the run, in
    order; nothing follows an exception. `follow(step, response)` gives the next step (default: a
    DecodeRun's, `next_decode`), or None: the run ends there (`next_answer` then returns END)."""

    def __init__(self, batcher: Batcher, loop: asyncio.AbstractEventLoop, first: object, steps: int,
                 observe: Callable[[float], None] = lambda s: None,
                 follow: Callable[[object, object], object | None] = next_decode) -> None:  # type: ignore[assignment]
        """`observe(seconds)`: each step's wall time from queued to answered (a metric; a queued
        step's: to its token read)."""
        self.batcher = batcher
        self.loop = loop
        self.first = first
        self.steps = steps
        self.observe = observe
        self.follow = follow
        self.answers: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def start(self) -> None:
        """Queue the first step (on the event loop)."""
        self._submit(self.first, 0)

    def cancel(self) -> None:
        """No further step is queued (the step in progress still runs)."""
        self.cancelled = True

    def _submit(self, step, k: int) -> None:
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

    async def _submit_later(self, step, k: int) -> None:
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

    def _watch(self, future: Future, step, k: int) -> None:
        t0 = time.perf_counter()

        def done(f: Future) -> None:  # on the model thread (or here, when already done)
            error = f.exception()
            response = f.result() if error is None else None
            if isinstance(response, QueuedAnswer):
                response.started = t0  # observed once its token is read (`next_answer`)
            else:
                self.observe(time.perf_counter() - t0)
            following = None
            if error is None and k + 1 < self.steps and not self.cancelled:
                following = self.follow(step, response)
                if following is not None:
                    self._submit(following, k + 1)  # before the answer goes out
            if isinstance(response, QueuedAnswer):
                response.followed(following is not None)
            self._deliver(error if error is not None else response)
            if error is None and following is None and k + 1 < self.steps and not self.cancelled:
                self._deliver(END)

        future.add_done_callback(done)

    def _deliver(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.answers.put_nowait, item)

    async def next_answer(self) -> object:
        """The next step's response (a QueuedAnswer's read in a worker thread: the event loop never
        waits for the device) or the exception that ended the run."""
        item = await self.answers.get()
        if isinstance(item, QueuedAnswer):
            queued = item

            def read() -> object:
                queued.wait_turn()
                return queued.response()

            item = await self.loop.run_in_executor(None, read)
            self.observe(time.perf_counter() - queued.started)
        return item
