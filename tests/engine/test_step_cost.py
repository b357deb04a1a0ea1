"""The online step cost (services/engine/step_cost.py): it learns a synthetic cost from the steps that
ran, sizes the prefill slice to the ITL target from it, and one disturbed step does not move it.

No timing: every step's duration comes from a synthetic cost t = a + b * rows + c * attended."""

from __future__ import annotations

import pytest

from services.engine.step_cost import StepBudget, StepCost, attended, pair_flops, shape
from services.engine.step_scheduler import Queued
from services.errors import InvalidRequest
from services.spec.cost import CostCurve

TRUE = (0.14, 0.0035, 3e-7)  # the "real" device: 140 ms a forward, 3.5 ms a row, 0.3 us a pair


def true_cost(ran: list[Queued], a: float = TRUE[0], b: float = TRUE[1], c: float = TRUE[2]) -> float:
    rows, pairs = shape(ran)
    return a + b * rows + c * pairs


def best_rows(target: float, decode_prefix: int, offset: int) -> int:
    """The most prompt rows beside one decode row whose true step time fits `target` (brute force)."""
    r = 0
    while true_cost([Queued(1, False, "d", prefix=decode_prefix), Queued(r + 1, True, "p", prefix=offset)]) <= target:
        r += 1
    return r


def slice_steps(budget: StepBudget, steps: int, offset: int = 0, slow: float = 1.0,
                outlier_at: int | None = None) -> list[tuple[int, int, float]]:
    """A decode beside a long prompt: each step asks the budget, runs one decode row and the prompt's
    slice of what is left, and reports the synthetic time (x `slow`; x 10 at step `outlier_at`).
    Returns (offset, prompt rows, seconds) per step."""
    out = []
    for i in range(steps):
        decode = Queued(1, False, "d", prefix=300 + i)
        rows = budget.rows([decode, Queued(512, True, "p", splittable=True, prefix=offset)]) - 1
        ran = [decode, Queued(rows, True, "p", prefix=offset)]
        seconds = true_cost(ran) * slow * (10 if i == outlier_at else 1)
        budget.observe(ran, seconds)
        out.append((offset, rows, seconds))
        offset += rows
    return out


def test_attended_pairs_and_a_step_shape():
    assert attended(4, 10) == 4 * 12.5  # rows 11, 12, 13, 14 attend to 11 + 12 + 13 + 14 keys
    assert shape([Queued(1, False, "d", prefix=300), Queued(100, True, "p", prefix=4000)]) == (101, 301 + 100 * 4050.5)


def test_the_prior_is_the_start_up_curve():
    a, b, c = StepCost.from_curve(CostCurve((1, 1000), (0.051, 1.05))).coefficients
    assert a == pytest.approx(0.05) and b == pytest.approx(0.001) and c == 0.0
    # before any step the budget is the curve's: 0.05 + 0.001 * rows <= 0.2 s -> 150 rows
    budget = StepBudget(StepCost.from_curve(CostCurve((1, 1000), (0.051, 1.05))), 0.2, 32, 1024)
    assert budget.rows([Queued(1, False, "d"), Queued(512, True, "p", True)]) == 150
    assert budget.rows([]) == 150
    # the attention term's prior: the model's FLOPs of a pair against a row's (SmolLM2-135M's shape)
    ratio = pair_flops(576, 1536, 9, 3, 64)
    assert ratio == pytest.approx(2304 / 7_077_888)
    assert StepCost.from_curve(CostCurve((1, 1000), (0.051, 1.05)), ratio).coefficients[2] == pytest.approx(0.001 * ratio)


@pytest.mark.parametrize("prior", [(0.3, 0.006), (0.05, 0.001)], ids=["too-slow", "too-fast"])
def test_the_budget_converges_to_the_real_cost_from_a_wrong_prior(prior):
    """A prior measured on a loaded machine (2x too slow) or an idle one (3x too fast): after 12
    steps the slice is within 6 rows of the most that fits 450 ms (about 80 rows) and the steps
    take 450 ms within 5%."""
    budget = StepBudget(StepCost(*prior), 0.45, 32, 1024)
    steps = slice_steps(budget, 40)
    first_rows = steps[0][1]
    for offset, rows, seconds in steps[12:]:
        assert abs(rows - best_rows(0.45, 300, offset)) <= 6, (offset, rows)
        assert seconds == pytest.approx(0.45, rel=0.05)
    if prior[0] > TRUE[0]:
        assert first_rows < 40 < steps[-1][1]  # the slice grew: the prior overestimated
    else:
        assert first_rows > 200 > steps[-1][1]  # the slice shrank: the prior underestimated


def test_a_slice_at_a_long_offset_is_smaller():
    """The attention term: after a prompt's first 4,000 rows the model has learned what a pair
    costs, and a slice at offset 8,000 gets fewer rows than one at offset 0."""
    budget = StepBudget(StepCost(0.14, 0.0035), 0.45, 32, 1024)
    slice_steps(budget, 60)
    a, b, c = budget.cost.coefficients
    assert c > 0
    near = budget.rows([Queued(1, False, "d"), Queued(512, True, "p", True, prefix=0)])
    far = budget.rows([Queued(1, False, "d"), Queued(512, True, "p", True, prefix=8000)])
    assert far < near
    assert abs((far - 1) - best_rows(0.45, 0, 8000)) <= 6, (far, best_rows(0.45, 0, 8000))


def test_one_disturbed_step_does_not_collapse_the_budget():
    """A step that took 10x its cost (another process's burst) is clipped and trimmed: the slices
    after it stay within 3 rows of the most that fits (without the clip and the trim they fall from
    77 to the 32-row floor)."""
    budget = StepBudget(StepCost(*TRUE[:2]), 0.45, 32, 1024)
    steps = slice_steps(budget, 30, outlier_at=20)
    assert steps[20][2] > 4.0  # the disturbed step
    assert all(abs(rows - best_rows(0.45, 300, off)) <= 3 for off, rows, _ in steps[21:])
    assert min(rows for _, rows, _ in steps[21:]) >= 0.9 * steps[19][1]


def test_a_machine_that_stays_slower_shrinks_the_slices():
    """Load that lasts (every step 1.5x) is not an outlier: the slices shrink until the steps fit the
    target again."""
    budget = StepBudget(StepCost(*TRUE[:2]), 0.45, 32, 1024)
    normal = slice_steps(budget, 20)
    loaded = slice_steps(budget, 40, offset=0, slow=1.5)
    assert loaded[-1][1] < 0.7 * normal[-1][1]
    assert loaded[-1][2] == pytest.approx(0.45, rel=0.05)


def test_floor_cap_and_decodes():
    """Decode rows count whole; the floor holds when even one prompt row misses the target."""
    budget = StepBudget(StepCost(0.05, 0.001), 0.2, 32, 1024)
    decodes = [Queued(16, False, f"t{i}", prefix=100) for i in range(4)]
    assert budget.rows(decodes + [Queued(512, True, "p", True)]) == 150  # 64 tree rows + 86 prompt rows
    assert StepBudget(StepCost(0.5, 0.001), 0.2, 32, 1024).rows([Queued(512, True, "p", True)]) == 32
    assert StepBudget(StepCost(0.0, 1e-6), 0.2, 32, 1024).rows([Queued(512, True, "p", True)]) == 1024


def test_invalid_settings_are_refused():
    with pytest.raises(InvalidRequest, match="target_s must be > 0"):
        StepBudget(StepCost(0.05, 0.001), 0.0, 32, 1024)
    with pytest.raises(InvalidRequest, match="ratio must be > 1"):
        StepBudget(StepCost(0.05, 0.001), None, 32, 1024, ratio=1.0)
    with pytest.raises(InvalidRequest, match="floor <= cap"):
        StepBudget(StepCost(0.05, 0.001), 0.2, 64, 32)
    with pytest.raises(InvalidRequest, match=">= 0"):
        StepCost(-1.0, 0.001)
    with pytest.raises(InvalidRequest, match="window must be >= 3"):
        StepCost(0.05, 0.001, window=2)


def test_the_auto_target_is_a_multiple_of_the_plain_step():
    """Auto (no target_s): a step may cost `ratio` x what its decodes cost alone (predicted before 3
    plain steps ran, then their median), so the slice follows the device: 3 x 51 ms -> 103 rows; a device whose forward's fixed cost
    is 10x smaller gets a target 10x smaller too, and trees of 16 rows raise the target with them."""
    budget = StepBudget(StepCost(0.05, 0.001), None, 8, 4096)
    one = [Queued(1, False, "d"), Queued(512, True, "p", True)]
    assert budget.target(one) == pytest.approx(0.153) and budget.rows(one) == 103
    fast = StepBudget(StepCost(0.005, 0.0001), None, 8, 4096)
    assert fast.target(one) == pytest.approx(0.0153) and fast.rows(one) == 103  # the same shape, 10x faster
    trees = [Queued(16, False, "d"), Queued(512, True, "p", True)]
    assert budget.target(trees) == pytest.approx(3 * 0.066) and budget.rows(trees) == 148
    assert budget.target([Queued(512, True, "p", True)]) == pytest.approx(0.153)  # no decode: one row's
    # learned: a prior 2x too slow; once 3 plain steps ran (their median: 2 x 0.144 s is disturbed),
    # the slices settle where a step costs 3 plain steps
    learned = StepBudget(StepCost(0.28, 0.007), None, 8, 1024)
    plain = true_cost([Queued(1, False, "d", prefix=330)])
    for seconds in (plain, 2 * plain, plain):
        learned.observe([Queued(1, False, "d", prefix=330)], seconds)
    assert learned.target(one) == pytest.approx(3 * plain)
    steps = slice_steps(learned, 30)
    assert all(seconds == pytest.approx(3 * plain, rel=0.05) for _, _, seconds in steps[10:])


def test_the_flag_takes_auto_or_milliseconds():
    import argparse

    from services.rpc.config import ConfigError, ServiceConfig
    from verifier_svc.config import VerifierConfig, add_flags, itl_target

    assert itl_target("auto") == "auto" and itl_target(" AUTO ") == "auto"
    assert itl_target("450") == 450.0 and itl_target("0") == 0.0
    for bad in ("fast", "-5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be 'auto' or a number of ms >= 0"):
            itl_target(bad)
    p = argparse.ArgumentParser()
    add_flags(p)
    assert p.parse_args(["--itl-target-ms", "auto"]).itl_target_ms == "auto"
    with pytest.raises(ConfigError, match="itl_target_ms must be 'auto' or a number of ms >= 0"):
        VerifierConfig(ServiceConfig(), itl_target_ms="soon")
    with pytest.raises(ConfigError, match="itl_target_ms must be 'auto' or a number of ms >= 0"):
        VerifierConfig(ServiceConfig(), itl_target_ms=-1.0)
