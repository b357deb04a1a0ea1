"""The step scheduler (services/engine/step_scheduler.py) alone and inside the batcher: every running
decode is in every step while long prompts prefill, prefill rows stay within the token budget, prompts
take turns in arrival order, decodes that fill the budget cannot starve a prompt, and the budget
follows the cost model.

No timing: the batcher's worker is driven by its own run_batch, which queues each sequence's next
call before it returns (as a coordinator does after each answer), so the steps are the same on any
machine; what is asserted is the rows each step holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from services.engine.batcher import Batcher, BatchLimits
from services.engine.step_cost import StepBudget, StepCost, attended
from services.engine.step_scheduler import STARVE_STEPS, Queued, Step, pick, plan, step_rows
from services.spec.budget import CostCurve


@dataclass(frozen=True)
class Call:
    seq: str
    rows: int
    prefill: bool
    left: int  # calls this sequence still sends after this one


class Driver:
    """run_batch: records each step's calls and queues each sequence's next call before returning."""

    def __init__(self) -> None:
        self.batcher: Batcher | None = None
        self.steps: list[list[Call]] = []
        self.done = threading.Event()
        self.gate = threading.Event()
        self.live = 0

    def __call__(self, calls: list[Call]) -> list:
        self.steps.append(list(calls))
        for c in calls:
            if c.left:
                self.batcher.submit(Call(c.seq, c.rows, c.prefill, c.left - 1), block=False)
            else:
                self.live -= 1
        if self.live == 0:
            self.done.set()
        return [None] * len(calls)


def run(calls: list[Call], budget: int | None, limits: BatchLimits = BatchLimits(max_batch=16, max_rows=1024),
        driver: Driver | None = None, learned: StepBudget | None = None, **batcher_kw):
    """Every call of `calls` queued before the first step, then steps until each sequence is done: the
    calls of each step. `driver` (default Driver()) runs the steps; `learned`: a budget learned from
    the steps (the Batcher's `budget`, used instead of `budget` rows); `batcher_kw` go to the Batcher."""
    d = driver or Driver()
    b = Batcher("test", d, rows=lambda c: c.rows, key=lambda c: c.seq, limits=limits,
                prefill=lambda c: c.prefill, step_rows=budget, budget=learned, **batcher_kw)
    d.batcher = b
    d.live = len(calls)
    try:
        b.exclusive(d.gate.wait, 10)  # every first call is queued before the first step
        for c in calls:
            b.submit(c)
        d.gate.set()
        assert d.done.wait(30)
    finally:
        b.close()
    return d.steps


def test_a_decode_runs_in_every_step_while_two_long_prompts_prefill():
    """A 4,096- and an 8,192-token prompt in 512-row chunks arrive before a running sequence's decode;
    budget 600 rows (max_rows 1,024): every step holds the decode and one chunk (513 rows), the
    prompts take turns. (In arrival order alone, the two chunks fill a 1,024-row step and the decode
    waits for every other step.)"""
    steps = run([Call("p4k", 512, True, 7), Call("p8k", 512, True, 15), Call("d", 1, False, 40)], budget=600)
    prefill_steps = [s for s in steps if any(c.prefill for c in s)]
    for s in prefill_steps:
        assert [c.seq for c in s if not c.prefill] == ["d"], s  # the decode, in every step
        assert sum(c.rows for c in s) == 513  # one chunk + the decode: within the budget
    assert sum(c.prefill for s in steps for c in s) == 24  # every chunk ran, one per step
    assert len(prefill_steps) == 24
    # turns while both prompts prefill: p4k, p8k, p4k, ... then p8k alone
    order = [next(c.seq for c in s if c.prefill) for s in prefill_steps]
    assert order[:16] == ["p4k", "p8k"] * 8 and order[16:] == ["p8k"] * 8


def test_decodes_that_fill_the_budget_do_not_starve_a_prompt():
    """Three running sequences verify 100-node trees (300 rows = the budget): the 64-row chunks of a
    prompt join beyond the budget once passed over STARVE_STEPS steps in a row."""
    trees = [Call(f"t{i}", 100, False, 40) for i in range(3)]
    steps = run(trees + [Call("p", 64, True, 4)], budget=300)
    with_prompt = [i for i, s in enumerate(steps) if any(c.prefill for c in s)]
    assert len(with_prompt) == 5
    assert with_prompt == [STARVE_STEPS * (k + 1) + k for k in range(5)]  # every (STARVE_STEPS + 1)th step
    assert all(sum(1 for c in steps[i] if not c.prefill) == 3 for i in with_prompt)  # decodes kept


def test_pick_rules():
    q = [Queued(512, True, "a"), Queued(1, False, "d"), Queued(512, True, "b"), Queued(8, False, "e")]
    assert pick(q, 16, 1024, budget=600) == [0, 1, 3]  # decodes first, then what fits
    assert pick(q, 16, 1024, budget=None) == [0, 1, 3]  # max_rows: 512 + 9 + 512 > 1024
    assert pick(q, 16, 1024, budget=100) == [1, 3]  # no chunk fits next to the decodes
    assert pick(q, 16, 1024, budget=100, starved=True) == [0, 1, 3]  # a passed-over prompt joins
    assert pick(q[:1], 16, 1024, budget=100) == [0]  # alone: never an empty step
    assert pick([Queued(2000, True, "a"), Queued(1, False, "d")], 16, 1024, budget=100) == [0]  # too big: alone
    assert pick([Queued(1, False, "d"), Queued(1, False, "d"), Queued(4, True, "p")], 16, 1024, 100) == [0, 2]
    # no overtaking inside a kind: the 600-row chunk blocks the later 10-row one
    assert pick([Queued(600, True, "a"), Queued(10, True, "b"), Queued(1, False, "d")], 16, 1024, 300) == [2]


def test_step_rows_follow_the_cost_model():
    cost = CostCurve((1, 1000), (0.05, 1.049))  # 50 ms + 1 ms per extra row
    assert step_rows(cost, 0.2, floor=8, cap=1024) == 151
    assert step_rows(cost, 0.5, floor=8, cap=1024) == 451
    assert step_rows(cost, 0.01, floor=32, cap=1024) == 32  # even the floor misses it: the floor
    assert step_rows(cost, 10.0, floor=8, cap=1024) == 1024  # the cap


@dataclass(frozen=True)
class Part:
    """A slice the batcher cut from a prefill Call (the Driver queues nothing after it)."""
    seq: str
    rows: int
    prefill: bool = True
    left: int = 0


CHUNK = 512


class SlicingDriver(Driver):
    """A Driver whose decoding sequences count down as they finish (the batcher's `decoding`)."""

    def __init__(self, decoders: int) -> None:
        super().__init__()
        self.decoders = decoders

    def __call__(self, calls: list) -> list:
        self.steps.append(list(calls))
        for c in calls:
            if isinstance(c, Part):
                continue
            if c.left:  # the next chunk is a whole one (this call may be the rest of a cut chunk)
                self.batcher.submit(Call(c.seq, CHUNK if c.prefill else c.rows, c.prefill, c.left - 1), block=False)
            else:
                self.live -= 1
                self.decoders -= not c.prefill
        if self.live == 0:
            self.done.set()
        return [None] * len(calls)


def split(call, rows: int):
    """(its first `rows` rows, the rest): the rest keeps the call's identity (and its `left`)."""
    return Part(call.seq, rows), Call(call.seq, call.rows - rows, True, call.left)


def run_sliced(calls: list[Call], budget: int, decoders: int) -> list[list]:
    d = SlicingDriver(decoders)
    return run(calls, budget, driver=d, split=split, decoding=lambda: d.decoders)


def test_a_step_carries_the_decode_and_a_slice_that_fills_the_budget():
    """Synthetic cost model: 50 ms + 1 ms a row, ITL target 120 ms -> a 71-row budget. An 8-chunk
    prompt (512-row chunks, one call each, sent one after the other as a coordinator sends them)
    prefills while a sequence decodes 16-row trees: every step holds the tree and a 55-row slice
    (71 rows: the budget, full) or a chunk's last 17 rows (the next chunk is sent after its answer);
    a chunk is cut across steps without a call of its own per slice, and once the decoding sequence
    finishes the rest of the prompt runs in whole chunks (one forward each)."""
    budget = step_rows(CostCurve((1, 1000), (0.05, 1.049)), 0.12, floor=8, cap=1024)
    assert budget == 71
    steps = run_sliced([Call("p", CHUNK, True, 7), Call("d", 16, False, 39)], budget, decoders=1)
    assert sum(c.rows for s in steps for c in s if c.prefill) == 8 * CHUNK  # every prompt row ran once
    assert all(any(not c.prefill for c in s) for s in steps[:40])  # the decode in 40 steps in a row
    assert [[c.rows for c in s] for s in steps[:40]] == ([[55, 16]] * 9 + [[17, 16]]) * 4
    assert [[c.rows for c in s] for s in steps[40:]] == [[CHUNK]] * 4  # alone: whole chunks


def test_a_slice_gets_half_the_budget_when_decodes_nearly_fill_it():
    """Trees of 60 rows against a 71-row budget: the prompt still gets 35 rows (half the budget) a step."""
    steps = run_sliced([Call("p", 512, True, 1), Call("d", 60, False, 9)], 71, decoders=1)
    assert all([c.rows for c in s if c.prefill] == [35] for s in steps[:10])
    assert all(sum(1 for c in s if not c.prefill) == 1 for s in steps[:10])


def test_a_prompt_alone_is_not_sliced():
    """No sequence decodes: the budget does not apply, each chunk is one forward (8 steps, not 58)."""
    steps = run_sliced([Call("p", 512, True, 7)], 71, decoders=0)
    assert [sum(c.rows for c in s) for s in steps] == [512] * 8


def test_plan_cuts_the_first_prefill_that_does_not_fit():
    q = [Queued(512, True, "a", splittable=True), Queued(16, False, "d"), Queued(512, True, "b", splittable=True)]
    assert plan(q, 16, 1024, budget=100) == Step([0, 1], (0, 84))  # the decode, then 84 of a's rows
    assert plan(q, 16, 1024, budget=None) == Step([0, 1])  # no budget: whole chunks (b waits: max_rows)
    assert plan(q, 16, 1024, budget=20) == Step([0, 1], (0, 10))  # half the budget, beyond it
    assert plan(q[:1], 16, 1024, budget=100) == Step([0], (0, 100))
    assert plan([Queued(2000, True, "a", splittable=True)], 16, 1024, budget=300) == Step([0], (0, 300))


class TimedDriver(SlicingDriver):
    """A SlicingDriver whose steps take a synthetic time on a manual clock (the batcher's `clock`):
    50 ms + 1 ms a row + 0.2 us per attended (query, key) pair; `done` counts each sequence's rows."""

    def __init__(self, decoders: int) -> None:
        super().__init__(decoders)
        self.now = 0.0
        self.done_rows: dict[str, int] = {}
        self.seconds: list[float] = []

    def cost(self, calls: list) -> float:
        return 0.05 + sum(0.001 * c.rows + 2e-7 * attended(c.rows, self.done_rows.get(c.seq, 0)) for c in calls)

    def __call__(self, calls: list) -> list:
        self.seconds.append(self.cost(calls))
        self.now += self.seconds[-1]
        for c in calls:
            self.done_rows[c.seq] = self.done_rows.get(c.seq, 0) + c.rows
        return super().__call__(calls)


def test_the_learned_budget_sizes_the_slices_to_the_real_cost():
    """The budget learned online inside the batcher (services/engine/step_cost.py), on a manual clock:
    the start-up curve says 100 ms + 2 ms a row (twice the real cost), so the first slices hold the
    prior's 50 rows for a 200 ms target (34 prompt rows beside a 16-row tree); after 10 steps the
    slices are sized by the real cost (about 110 rows early in the prompt, fewer as the prefix
    grows: each row attends to it), every full step from then on takes 200 ms within 3%, the tree
    is in each of them, and once the decoding sequence finished the rest of the prompt runs in whole
    chunks."""
    d = TimedDriver(decoders=1)
    budget = StepBudget(StepCost.from_curve(CostCurve((1, 64), (0.102, 0.228))), 0.2, 8, 1024)
    prior_rows = budget.rows([Queued(16, False, "d"), Queued(512, True, "p", True)])
    assert prior_rows == 50
    steps = run([Call("p", CHUNK, True, 7), Call("d", 16, False, 34)], None, driver=d, split=split,
                decoding=lambda: d.decoders, learned=budget, prefix=lambda c: d.done_rows.get(c.seq, 0),
                clock=lambda: d.now)
    assert sum(c.rows for s in steps for c in s if c.prefill) == 8 * CHUNK  # every prompt row ran once
    beside = [i for i, s in enumerate(steps) if any(not c.prefill for c in s) and any(c.prefill for c in s)]
    assert beside[:12] == list(range(12))  # the tree in every step while the prompt prefills
    assert [c.rows for c in steps[0] if c.prefill] == [prior_rows - 16]  # the prior's slice
    full = [i for i in beside[10:] if any(isinstance(c, Part) for c in steps[i])]  # a cut: the budget's rows
    assert len(full) > 15
    assert all(abs(d.seconds[i] - 0.2) <= 0.006 for i in full), [round(d.seconds[i], 3) for i in full]
    slices = [sum(c.rows for c in steps[i] if c.prefill) for i in full]
    assert slices[0] > 100 and slices[-1] < 0.8 * slices[0]  # twice the prior's rows; fewer far into the prompt
    assert [[c.rows for c in s] for s in steps[35:]] == [[CHUNK]] * 2  # alone again: whole chunks
