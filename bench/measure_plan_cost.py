"""Time one `Budget._choose` (the tree search of a plan) against the number of other sequences in
the batch, with and without the O(depth) bound that skips the search when plain clearly wins.

    .venv/bin/python bench/measure_plan_cost.py [--head services/heads/smollm2-135m-eagle] [--calls 400]

The cost model is a synthetic CPU-like curve (55 ms for one row, 3.5 ms per extra row; a draft
step 1-4 ms); the loads are plain sequences whose measured extras vary from call to call, as on the
load board. Prints ms per plan and the plan chosen (the same with and without the bound)."""

from __future__ import annotations

import argparse
import math
import random
import time
from unittest import mock

import services.spec.budget as budget_mod
from services.engine.calibration import load_report
from services.spec.acceptance import prior_stats
from services.spec.budget import AUTO_LARGEST, Budget
from services.spec.cost import CostCurve, CostModel
from services.spec.load_board import Load

ROWS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default="services/heads/smollm2-135m-eagle", help="head dir whose report is the prior")
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    costs = CostModel(CostCurve(ROWS, tuple(0.055 + 0.0035 * (r - 1) for r in ROWS)),
                      CostCurve((1, 16), (0.0012, 0.004)), CostCurve((1, 16), (0.0009, 0.003)))
    b = Budget(costs, prior_stats(load_report(args.head)), largest=AUTO_LARGEST)
    print(f"{'others':>6}  {'full search ms':>14}  {'with bound ms':>13}  plan")
    for others in (0, 1, 3, 7, 15):
        times, plans = {}, {}
        for label in ("full", "bound"):
            rng = random.Random(1)
            patch = (mock.patch.object(budget_mod, "_eagle_bound", lambda *a: math.inf) if label == "full"
                     else mock.patch.object(budget_mod, "MAX_RANK", budget_mod.MAX_RANK))
            stats = b.new_stats()
            with patch:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    load = (Load(others, others + rng.choice([0, 0, 0, 3]), float(others), 0.0,
                                 rng.uniform(0.005, 0.02), rng.uniform(0.01, 0.05)) if others else Load())
                    plans[label] = b._choose(stats, 0, 2.0, load)[0]
                times[label] = (time.perf_counter() - t0) / args.calls * 1e3
        assert plans["full"] == plans["bound"]
        tree = plans["bound"].tree
        shape = "plain" if tree is None else f"top_k {tree.top_k}, depth {tree.depth}, {tree.size} nodes"
        print(f"{others:>6}  {times['full']:>14.3f}  {times['bound']:>13.3f}  {shape}")


if __name__ == "__main__":
    main()
