"""The model runner: a target model, a KV pool, and one forward per Step.

    runner = ModelRunner(target, KVPool.for_model(target, max_rows))
    slot = runner.allocate(rows)             # KV for one sequence (CapacityExceeded naming the budget)
    out = runner.execute(Step(entries))      # one target forward for every entry -> StepOutput
    runner.keep(slot, start, rows [n])       # compaction of an accepted path
    runner.grow(slot, rows)                  # `rows` more KV rows for a slot (KVBudgetExceeded when full)
    runner.release(slot)

It does the forward and the KV bookkeeping only: no acceptance, no sampling, no sequences ids, no
RPC. The verifier (services/engine/verifier.py) calls it through these five methods only, so a
tensor-parallel group proxy with the same five methods (every rank runs a ModelRunner over its
shard and its own pool; arguments are picklable, tensors on the CPU are fine) can stand in for it.
Calls are deterministic: the same calls in the same order give the same slots and rows on every rank.

On CUDA the pool is a `PagedKVPool` (one arena, a page table per sequence) and every step whose
entries are short (decodes, trees, small chunks: services/model/uniform.py) runs the static-shape
forward, replayed from a CUDA graph per padded shape (AERIE_CUDA_GRAPHS=0: eagerly); longer steps
(prefill chunks) run the per-entry forward over the same pages. On the CPU: a KVPool of contiguous
slots and the per-entry forward, as before.
"""

from __future__ import annotations

import logging
import os

import torch

from services.errors import CapacityExceeded, InvalidRequest
from services.model.kv_pool import KVPool
from services.model.paged_kv import PagedKVPool
from services.model.step import Step, StepOutput
from services.model.target import TargetModel
from services.model.uniform import WIDTH_BUCKETS, UniformRunner, WarmUp

log = logging.getLogger(__name__)

GRAPHS_ENV = "AERIE_CUDA_GRAPHS"


WARM_UP_ENV = "AERIE_GRAPH_WARMUP"
PAGED_ENV = "AERIE_PAGED_KV"  # 1: paged KV and the static-shape paths on the CPU too (paged_default)


def _on_cuda_unless_off(device: torch.device, env: str) -> bool:
    return device.type == "cuda" and os.environ.get(env, "1") not in ("0", "false", "no", "off")


def warm_up_default(device: torch.device) -> bool:
    """Start-up warm-up of the static shapes (ModelRunner.warm_up): on CUDA unless AERIE_GRAPH_WARMUP=0."""
    return _on_cuda_unless_off(device, WARM_UP_ENV)


def warm_up_at_start(runner, max_sequences: int) -> WarmUp | None:
    """`runner.warm_up` on CUDA (warm_up_default), logged with its time and memory; a runner without
    it (a tensor-parallel proxy) is left alone, and a failure is logged, not raised: shapes then
    capture on first use, as without the warm-up."""
    warm = getattr(runner, "warm_up", None)
    if warm is None or not warm_up_default(runner.device):
        return None
    try:
        done = warm(max_sequences)
    except Exception:  # noqa: BLE001 (serving goes on: the shapes are prepared on first use instead)
        log.exception("the start-up warm-up of the static shapes failed; they are captured on first use")
        return None
    if done is not None:
        log.info("%s (%s=0 skips this)", done.describe(), WARM_UP_ENV)
    return done


def graphs_default(device: torch.device) -> bool:
    """CUDA graphs: on by default on CUDA (AERIE_CUDA_GRAPHS=0 turns them off), never on the CPU."""
    return _on_cuda_unless_off(device, GRAPHS_ENV)


def paged_default(device: torch.device) -> bool:
    """Paged KV (and the static-shape code over it: the target's uniform forward, the head's static
    drafts, the rounds kept on the device): on CUDA; on the CPU only with AERIE_PAGED_KV=1, which runs
    the GPU's code paths eagerly there (to measure their host work, and in tests)."""
    if device.type == "cuda":
        return True
    value = os.environ.get(PAGED_ENV, "0").strip()
    if value not in ("0", "1"):
        raise InvalidRequest(f"{PAGED_ENV} must be 0 or 1; got {value!r}")
    return value == "1"


def pool_for(target: TargetModel, max_rows: int | None = None, paged: bool | None = None) -> KVPool:
    """The KV pool a runner of `target` uses: paged on CUDA (its arena sized by `max_rows`, default
    half the free memory), contiguous slots on the CPU (`paged` forces either; AERIE_PAGED_KV=1:
    paged there too, paged_default)."""
    if paged if paged is not None else paged_default(target.device):
        return PagedKVPool.for_model(target, max_rows)
    return KVPool.for_model(target, max_rows)


class ModelRunner:
    def __init__(self, target: TargetModel, pool: KVPool | None = None, graphs: bool | None = None) -> None:
        """`pool` None: `pool_for(target)`; `graphs` None: on for CUDA (graphs_default). A paged pool
        runs short steps through the static-shape forward (graphs or not)."""
        self.target = target
        self.pool = pool if pool is not None else pool_for(target)
        self.uniform: UniformRunner | None = None
        if isinstance(self.pool, PagedKVPool):
            on = graphs_default(target.device) if graphs is None else graphs
            self.uniform = UniformRunner(target, self.pool, graphs=on)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def warm_up(self, max_sequences: int) -> WarmUp | None:
        """Before the first request (a paged pool only; None otherwise): the static shapes of plain
        decodes of 1, 2, 4 and 8 sequences (up to `max_sequences`) and of one sequence's trees of 2-64
        rows, with and without EAGLE-3 taps, each captured as a CUDA graph (or run once eagerly with
        graphs off): the fused stages compile and the graphs exist before a request waits for them.
        Every write goes to the trash page."""
        if self.uniform is None:
            return None
        taps = (False, True)
        decode = self.uniform.warm_up(tuple(b for b in (1, 2, 4, 8) if b <= max(1, max_sequences)), (1,), taps)
        trees = self.uniform.warm_up((1,), WIDTH_BUCKETS[1:], taps)
        return WarmUp(decode.shapes + trees.shapes, decode.seconds + trees.seconds,
                      decode.memory_bytes + trees.memory_bytes, decode.graphs)

    def allocate(self, rows: int) -> int:
        """A KV slot of `rows` rows (length 0); CapacityExceeded when the pool's budget is full."""
        return self.pool.allocate(rows)

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    def grow(self, slot: int, rows: int) -> None:
        """Reserve `rows` more KV rows for `slot` (KVBudgetExceeded, nothing changed, when they do not fit)."""
        self.pool.grow(slot, rows)

    def keep(self, slot: int, start: int, rows: torch.Tensor | list[int]) -> None:
        """Keep the KV rows at absolute indices `rows` [n] (ascending, rows[i] >= start + i) at
        [start, start + n) of `slot`; drop every later row (the rest of a verified tree)."""
        self.pool.keep(slot, start, torch.as_tensor(rows, dtype=torch.long))

    def execute(self, step: Step) -> StepOutput:
        """One target forward over every entry (each entry's rows are appended to its slot).
        Raises before writing anything when an entry's slot cannot take its rows, or when two
        entries name the same slot."""
        slots = [e.slot for e in step.entries]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step names a KV slot twice: {slots}")
        if not slots:
            raise ValueError("a step needs at least one entry")
        caches = [self.pool.cache(s) for s in slots]
        for e, cache in zip(step.entries, caches, strict=True):
            if cache.length + e.rows > cache.capacity:
                raise CapacityExceeded(f"KV slot {e.slot} holds {cache.capacity} rows; {cache.length} used, "
                                       f"{e.rows} more requested")
        if self.uniform is not None:
            shape = self.uniform.shape_for(step)
            if shape is not None:
                return self.uniform.execute(step, shape)
        return self.target.forward_step(step, caches)
