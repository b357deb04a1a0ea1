"""One tensor-parallel group = one verifier: the rank-0 proxy and the worker loop.

    proxy = GroupRunner(runner, comm)       # rank 0: ModelRunner's five methods, broadcast to all ranks
    serve_worker(runner, comm)              # ranks 1..N-1: run the same calls in the same order

`GroupRunner` stands in for a `ModelRunner` under the rank-0 `Verifier` (services/engine/verifier.py,
which keeps acceptance, sampling and replay): each call (method name + arguments, tensors moved to
the CPU) is broadcast to every rank in order, then run on rank 0's own runner, whose result
(full logit rows on rank 0: services/model/tp.py) is returned. Workers run the same call on their
shard; their results are dropped. Calls are deterministic, so every rank's KV pool hands out the
same slots.

Liveness: when no call has gone out for `heartbeat_s`, a background thread broadcasts a ping, so
idle workers' collectives never hit the deadline and a dead worker is found while idle too. The
first failed collective (services/dist/group.py: a deadline on each) marks the group dead: every
later call raises `GroupError` at once (the verifier service answers UNAVAILABLE and reports health
NOT_SERVING), never a hang. A worker whose rank 0 is gone misses the next ping and exits.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import fields, is_dataclass, replace

import torch

from services.dist.group import GroupError
from services.errors import AerieError
from services.model.step import Step

log = logging.getLogger("aerie.dist")

METHODS = ("allocate", "release", "keep", "grow", "execute")
PING, STOP = "ping", "stop"


def to_host(obj):
    """`obj` with every tensor (inside tuples, lists and dataclasses such as Step) on the CPU, so it
    pickles to any rank whatever its device."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(x) for x in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: to_host(getattr(obj, f.name)) for f in fields(obj)})
    return obj


class GroupRunner:
    """The rank-0 side of a group: the ModelRunner interface, broadcast to every rank."""

    def __init__(self, runner, comm, heartbeat_s: float | None = None, on_close=None) -> None:
        self.runner = runner
        self.target = runner.target  # rank 0's shard: full config, full logits and features
        self.comm = comm
        self.world = comm.world
        self.error: GroupError | None = None
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._on_close = on_close  # e.g. stop the executor's worker processes
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(0.2, comm.timeout_s / 4)
        self._pinger = threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True)
        self._pinger.start()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed.is_set()

    # ---- the ModelRunner interface -------------------------------------------------------------------

    def allocate(self, rows: int) -> int:
        return self._call("allocate", rows)

    def release(self, slot: int) -> None:
        return self._call("release", slot)

    def grow(self, slot: int, rows: int) -> None:
        return self._call("grow", slot, rows)

    def keep(self, slot: int, start: int, rows) -> None:
        return self._call("keep", slot, start, rows)

    def execute(self, step: Step):
        return self._call("execute", step)

    def run_all(self, fn_path: str, *args):
        """Call `fn_path` ("module:function") with (runner, *args) on every rank in step, e.g. a cost
        calibration whose forwards need every rank; rank 0's result."""
        return self._call("fn", fn_path, *args)

    # ---- internals -------------------------------------------------------------------------------

    def _call(self, method: str, *args):
        with self._lock:
            self._check()
            try:
                self.comm.broadcast_object((method, to_host(args)))
            except GroupError as e:
                self._fail(e)
                raise
            finally:
                self._last = time.monotonic()
            try:
                return run_method(self.runner, method, args)
            except GroupError as e:  # a collective inside the forward
                self._fail(e)
                raise

    def _check(self) -> None:
        if self._closed.is_set():
            raise GroupError("the tensor-parallel group is shut down")
        if self.error is not None:
            raise GroupError(f"the tensor-parallel group of {self.world} ranks is down: {self.error}")

    def _fail(self, e: GroupError) -> None:
        if self.error is None:
            log.error("tensor-parallel group failed: %s", e)
            self.error = e

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 2):
            if self.error is not None:
                return
            if time.monotonic() - self._last < self.heartbeat_s:
                continue
            with self._lock:
                if self._closed.is_set() or self.error is not None:
                    return
                try:
                    self.comm.broadcast_object((PING, ()))
                except GroupError as e:
                    self._fail(e)
                    return
                finally:
                    self._last = time.monotonic()

    def close(self) -> None:
        """Tell the workers to stop (best effort), then release the group."""
        if self._closed.is_set():
            return
        with self._lock:
            self._closed.set()
            if self.error is None:
                try:
                    self.comm.broadcast_object((STOP, ()))
                except GroupError:
                    pass
        self.comm.close()
        if self._on_close is not None:
            self._on_close()


def run_method(runner, method: str, args: tuple):
    if method in METHODS:
        return getattr(runner, method)(*args)
    if method == "fn":
        import importlib

        module, _, name = args[0].partition(":")
        return getattr(importlib.import_module(module), name)(runner, *args[1:])
    raise ValueError(f"unknown group call {method!r}")


def serve_worker(runner, comm) -> int:
    """A worker rank's loop: run rank 0's calls in order until STOP (0) or a failed collective
    (1: rank 0 or a peer is gone). Deterministic refusals (AerieError: a full KV pool, ...) happen
    on rank 0 too and do not stop the loop; any other error does (this rank would fall out of step)."""
    while True:
        try:
            method, args = comm.broadcast_object()
        except GroupError as e:
            log.error("worker rank %d: %s", comm.rank, e)
            return 1
        if method == STOP:
            return 0
        if method == PING:
            continue
        try:
            run_method(runner, method, args)
        except GroupError as e:
            log.error("worker rank %d: %s", comm.rank, e)
            return 1
        except AerieError:
            continue


def calibrate_runner(runner, vocab: int, rows=None, prefix: int = 128, repeats: int = 5):
    """t_verify(rows) through the ModelRunner interface (a local runner or a GroupRunner: then the
    broadcasts are in the measurement, as they are in every served round): a tree-attention forward
    over `rows` chain nodes after `prefix` tokens, the tree dropped after each."""
    from services.model.step import StepEntry
    from services.engine.calibration import VERIFY_ROWS, time_calls

    rows = tuple(rows or VERIFY_ROWS)
    slot = runner.allocate(prefix + max(rows))
    g = torch.Generator().manual_seed(0)
    try:
        runner.execute(Step((StepEntry(slot, torch.randint(0, vocab, (prefix,), generator=g), logits="last"),)))

        def run(r: int) -> None:
            ids = torch.randint(0, vocab, (r,), generator=g)
            mask = torch.ones(r, r, dtype=torch.bool).tril()
            runner.execute(Step((StepEntry(slot, ids, prefix + torch.arange(r), mask),)))
            runner.keep(slot, prefix, [])

        return time_calls(run, rows, repeats)
    finally:
        runner.release(slot)


def group_costs(proxy: GroupRunner, model_id: str, recalibrate: bool = False):
    """The group's t_verify curve, cached like services/engine/calibration.py `target_costs` (keyed by the
    group size too)."""
    from services.engine.calibration import cached, cost_key
    from services.spec.cost import CostCurve

    target = proxy.target
    key = cost_key("verify", f"{model_id}|tp={proxy.world}", target.device, target.dtype)
    return CostCurve.from_dict(cached(key, lambda: calibrate_runner(proxy, target.config.vocab_size).to_dict(),
                                      recalibrate))
