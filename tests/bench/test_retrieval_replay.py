"""bench/retrieval_replay.py: the oracle counts exactly what a chain would get accepted, the budget's
replay never beats the oracle, and the candidate list follows its ranking rule."""

import importlib.util
from pathlib import Path

from services.spec.acceptance import prior_stats
from services.spec.budget import Budget
from services.spec.cost import CostCurve, CostModel

spec = importlib.util.spec_from_file_location(
    "retrieval_replay", Path(__file__).resolve().parents[2] / "bench" / "retrieval_replay.py")
rr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rr)

TV = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.1, 1.2, 1.4, 1.7, 2.6))


def test_candidates_rank_longest_match_then_most_recent():
    text = [1, 2, 3, 9, 2, 4, 5, 1, 2, 6, 1, 2]
    # suffix [1 2]: earlier at ends 1 (-> 3 9 ...) and 8 (-> 6 1 2), both 2 long: most recent first
    assert rr.candidates(text, 2, limit=2) == [[6, 1], [3, 9]]
    assert rr.candidates([5, 1, 2, 7, 5, 1, 2], 1, limit=3) == [[7, 5, 1]]  # a 3-long match wins
    assert rr.candidates([1, 2, 3], 4) == []


def test_oracle_counts_exactly_the_copied_run_and_bounds_the_budget():
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 2
    answer = [10, 11, 12, 13, 14, 15, 40, 41]  # copies 6 tokens from the prompt, then new ones
    tokens, rounds, cost = rr.replay(prompt, answer, "oracle", None, TV)
    # round 1: root 10 ([19 10] occurred), the chain [11 12 ...] accepts 11..15 (5) + bonus 40;
    # round 2: root 40 (no match) -> 41
    assert tokens == len(answer) - 1 and rounds == 2
    assert cost == TV(6) / TV(1) + 1.0
    budget = Budget(CostModel(TV), prior_stats(), eagle=False)
    bt, brounds, bcost = rr.replay(prompt, answer, "budget", budget, TV)
    assert bt == tokens and brounds >= rounds and bt / bcost <= tokens / cost + 1e-9
