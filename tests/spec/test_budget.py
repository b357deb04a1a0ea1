"""The draft budget: expected accept lengths, EMA updates, the chooser on synthetic cost tables
(it must pick the known best shape, plain decoding included), dynamic depth
(the cost cache: tests/engine/test_calibration.py)."""

import math
from dataclasses import replace

import pytest
import torch

from services.errors import InvalidRequest
from services.spec import acceptance as A
from services.spec import budget as B
from services.spec.acceptance import (AcceptanceStats, chain_accept, ema, expected_accept, observe, observe_realized,
                                      prior_stats)
from services.spec.budget import Budget, RoundPlan
from services.spec.cost import CostCurve, CostModel
from services.spec.tree import TreeParams, build_tree, expand, extend, grow_tree, rerank
from tests.spec.test_tree import random_head


def stats(a, c=(0.2,), s=0.5, conf=None) -> AcceptanceStats:
    a = list(a) + [a[-1]] * (A.MAX_LEVELS - len(a))
    c = list(c) + [c[-1]] * (A.MAX_RANK - 1 - len(c))
    return AcceptanceStats(a, c, [s] * A.MAX_LEVELS, confidence=conf or a[0])


def linear(per_row: float, base: float, rows=(1, 2, 4, 8, 16, 32, 64)) -> CostCurve:
    return CostCurve(rows, tuple(base + per_row * (r - 1) for r in rows))


def test_expected_accept_by_hand():
    assert expected_accept([0.5, 0.5], [0.2], 1, 2, [1, 2]) == pytest.approx([0.5, 0.75])
    # top_k 2, one level: rank 1 0.5, rank 2 (1 - 0.5) * 0.4 = 0.2
    assert expected_accept([0.5], [0.4], 2, 1, [1, 2]) == pytest.approx([0.5, 0.7])
    assert chain_accept([0.5, 0.5, 0.5], 3) == pytest.approx(0.5 + 0.25 + 0.125)


def test_ema_and_prior():
    assert ema(0.2, 1.0, 0.15) == pytest.approx(0.32)
    assert ema(0.2, 0.0, 0.15) == pytest.approx(0.17)
    p = prior_stats({"top1_agreement": 0.6})
    assert p.depth[0] == pytest.approx(0.6) and p.depth[1] == pytest.approx(0.6 * A.DEEPER_DECAY)
    assert prior_stats(None).depth[0] == A.CONSERVATIVE_A
    assert prior_stats({"nothing": 1}).depth[0] == A.CONSERVATIVE_A


def test_observe_updates_depth_rank_and_chain():
    # root 0 -> 1 (score -0.1), 2 (-0.5); 1 -> 3 (-0.3); chain node 4 hangs from 2 (appended)
    tree = build_tree(torch.tensor([9, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 2]),
                      torch.tensor([0.0, -0.1, -0.5, -0.3, 0.0]), False)
    s = stats([0.5, 0.5], c=[0.5], s=0.5)
    observe(s, tree, [0, 2, 4], chain_nodes=[2, 4], eagle_size=4)
    # depth 1: the top child (1) was rejected, rank 2 (node 2) accepted
    assert s.depth[0] == pytest.approx(ema(0.5, 0.0, s.alpha))
    assert s.rank[0] == pytest.approx(ema(0.5, 1.0, s.alpha))
    # node 2 has no EAGLE children: depth 2 is not observed
    assert s.depth[1] == 0.5
    # the chain's depth 1 (node 2) and depth 2 (node 4) were both accepted
    assert s.chain[:2] == pytest.approx([ema(0.5, 1.0, s.alpha)] * 2)
    assert s.confidence == pytest.approx(ema(0.5, math.exp(-0.1), s.alpha))

    s = stats([0.5, 0.5], c=[0.5])
    observe(s, tree, [0, 1], eagle_size=5)  # accepted 1, then its child 3 rejected
    assert s.depth[:2] == pytest.approx([ema(0.5, 1.0, s.alpha), ema(0.5, 0.0, s.alpha)])
    assert s.rank[0] == 0.5  # rank 1 hit: rank 2 not observed


FLAT_GPU = CostModel(CostCurve((1, 32, 64), (1.0, 1.0, 2.0)), linear(0.0, 0.01), linear(0.0, 0.01))


@pytest.mark.parametrize("case", ["plain", "one_token", "long_chain", "wide_tree"])
def test_chooser_picks_the_known_best_shape(case):
    if case == "plain":  # the shipped head on a CPU: low acceptance, verify grows per node
        b = Budget(CostModel(linear(0.3, 1.0), linear(0.0, 0.05), linear(0.05, 0.15)))
        plan = b.plan(stats([0.1]))
        assert plan.tree is None and plan.chain == 0 and plan.rate == pytest.approx(1.0)
    elif case == "one_token":  # two rows cost little more than one, three cost double
        costs = CostModel(CostCurve((1, 2, 3, 64), (1.0, 1.1, 2.0, 50.0)), linear(0, 0.0), linear(0, 0.02))
        plan = Budget(costs).plan(stats([0.6], c=[0.0]))
        assert plan.tree == TreeParams(1, 0, 2, plan.tree.stop_logprob)
        assert plan.tokens == pytest.approx(1.6)
    elif case == "long_chain":  # nearly free verification up to 32 rows, siblings never accepted
        costs = CostModel(CostCurve((1, 32, 64), (1.0, 1.0, 2.0)), linear(0.01, 0.0), linear(0.0, 0.005))
        plan = Budget(costs).plan(stats([0.95], c=[0.0]))
        assert (plan.tree.top_k, plan.tree.depth, plan.tree.size) == (1, 7, 9)
    else:  # the top child is a coin flip, the runner-up is usually right: branch
        plan = Budget(FLAT_GPU).plan(stats([0.5], c=[0.8]))
        assert plan.tree.top_k >= 2 and plan.tree.size > plan.tree.depth + 2


def test_realized_gain_scales_predictions_and_turns_an_overestimated_tree_plain():
    """`realized` (the measured share of the predicted head gain) moves by EMA on drafting rounds
    only, stays in its bounds, and scales the chooser's gains: the one_token case above (1.6
    predicted tokens, pays) is plain once only a tenth of its gain comes true."""
    s = stats([0.6], c=[0.0])
    plan = RoundPlan(TreeParams(1, 0, 2), 0, 1.6, 1.1, head_gain=0.6)
    observe_realized(s, plan, 1)  # nothing accepted: ratio 0
    assert s.realized == pytest.approx(ema(1.0, 0.0, s.alpha))
    before = s.realized
    observe_realized(s, replace(plan, chain=2), 3)  # a retrieved chain joined: not the head's alone
    observe_realized(s, RoundPlan(None, 0, 1.0, 1.0), 1)  # plain
    assert s.realized == before
    for _ in range(100):
        observe_realized(s, plan, 3)  # 2 accepted against 0.6 predicted
    assert s.realized == A.REALIZED_MAX
    for _ in range(100):
        observe_realized(s, plan, 1)
    assert s.realized == A.REALIZED_MIN
    costs = CostModel(CostCurve((1, 2, 3, 64), (1.0, 1.1, 2.0, 50.0)), linear(0, 0.0), linear(0, 0.02))
    full = Budget(costs).plan(stats([0.6], c=[0.0]))
    assert full.tree is not None and full.head_gain == pytest.approx(0.6)
    tenth = stats([0.6], c=[0.0])
    tenth.realized = 0.1  # 1 + 0.06 tokens for 1.12 s: below plain's 1 token per second
    assert Budget(costs).plan(tenth).tree is None
    assert tenth.copy().realized == tenth.realized


def test_chooser_joins_a_chain_when_it_pays_and_drops_it_when_not():
    b = Budget(FLAT_GPU, chain_limit=8)
    good = b.plan(stats([0.1], s=0.9), chain=8)
    assert good.chain == 8
    costly = Budget(CostModel(linear(0.5, 1.0)), eagle=False, chain_limit=8)
    assert costly.plan(stats([0.1], s=0.2), chain=8).chain == 0
    assert costly.plan(stats([0.1], s=0.95), chain=8).chain >= 1


def test_fixed_shape_is_kept_and_plain_rounds_probe():
    fixed = TreeParams(2, 3, 10)
    b = Budget(CostModel(linear(0.3, 1.0)), largest=fixed, fixed=fixed)
    assert b.plan(stats([0.01])).tree == fixed
    b = Budget(CostModel(linear(0.3, 1.0), linear(0, 0.05), linear(0, 0.05)), probe_every=4, probe_backoff=1)
    s = stats([0.05])
    plans = [b.plan(s) for _ in range(8)]
    assert [p.drafts for p in plans] == [False, False, False, True] * 2
    assert plans[3].tree.size == 2 and plans[3].chain == 0
    # a probe after which the budget stays plain doubles the gap, up to probe_backoff x probe_every
    b = replace(b, probe_backoff=4)
    s = stats([0.05])
    probes = [i for i in range(40) if b.plan(s).drafts]
    assert probes == [3, 11, 27, 43 - 4][:3], probes  # gaps 4, 8, 16 (then 16: capped)
    assert [i for i in range(40, 80) if b.plan(s).drafts] == [43, 59, 75]
    # a drafting round resets the gap
    s.depth = [0.95] * A.MAX_LEVELS
    assert b.plan(s).drafts and s.probe_gap == 0 and s.idle_rounds == 0
    # a probe with a retrieved chain verifies its first PROBE_CHAIN tokens (not a 16-row verify)
    b = Budget(CostModel(linear(0.3, 1.0)), eagle=False, chain_limit=8, probe_every=2, probe_backoff=1)
    s = stats([0.05], s=0.05)
    assert [b.plan(s, chain=6).chain for _ in range(4)] == [0, B.PROBE_CHAIN, 0, B.PROBE_CHAIN]
    assert [b.plan(s, chain=3).chain for _ in range(2)] == [0, 3]
    b = Budget(CostModel(linear(0.3, 1.0), linear(0, 0.05), linear(0, 0.05)), chain_limit=8, probe_every=2)
    s = stats([0.05], s=0.05)
    probe = [b.plan(s, chain=8) for _ in range(2)][-1]
    assert probe.tree.size == 2 and probe.chain == B.PROBE_CHAIN


def test_stop_logprob_from_costs():
    b = Budget(CostModel(linear(0.3, 1.0), linear(0, 0.05), linear(0, 0.05)))
    s = stats([0.7], conf=0.7)
    plan = b.plan(s)
    assert plan.tree is not None
    # a node must be accepted with p >= rate * dt to pay: 1 verified row (0.3) + one step
    dt = 0.1 / plan.tree.top_k + 0.3
    assert math.exp(plan.tree.stop_logprob) == pytest.approx(plan.rate * dt / 1.0, rel=1e-6)


def test_dynamic_depth_stops_expansion_and_drops_unlikely_nodes():
    head = random_head()
    feats, toks = torch.randn(6, 32), torch.randint(0, 50, (6,))
    cache = head.new_cache(100)
    last = extend(head, cache, feats, toks)
    full = rerank(expand(head, cache, last, TreeParams(3, 4, 20)), 7, TreeParams(3, 4, 20), False)
    best = float(full.scores[1:].max())
    above = TreeParams(3, 4, 20, stop_logprob=min(0.0, best + 1e-3))  # no node pays
    cand = expand(head, cache, last, above)
    assert cand.scores.shape[0] == 3, "no level is expanded when its best node is below the threshold"
    tree = rerank(cand, 7, above, False)
    assert tree.size == 2 and tree.tokens[1] == full.tokens[1], "one draft node is always kept"
    below = TreeParams(3, 4, 20, stop_logprob=best - 1e-4)  # only the best first-level node pays
    cand = expand(head, cache, last, below)
    assert cand.scores.shape[0] == 3 + 3, "only the best node's branch was expanded, its children fall below: stop"
    assert rerank(cand, 7, below, False).size == 2
    assert cache.length == 6
    # -inf = the plain EAGLE-2 tree
    same = grow_tree(head, head.new_cache(100), feats, toks, TreeParams(3, 4, 20), False)
    assert torch.equal(same.tokens[1:], full.tokens[1:])


def test_dynamic_depth_prunes_branches_and_keeps_the_tree_that_dropping_afterwards_gives():
    """Per branch: only frontier nodes at or above the stop feed the next head step. The tree is the
    one that expanding every branch to the same depth and then dropping the nodes below the stop
    gives (a pruned node's children score lower still), with fewer head rows."""
    import services.spec.tree as tree_mod

    head = random_head()
    g = torch.Generator().manual_seed(5)
    rows_fed = []
    forward = head.forward_batch

    def counting(features, *args, **kwargs):
        rows_fed.append(int(features.shape[0]))
        return forward(features, *args, **kwargs)

    head.forward_batch = counting
    fewer = 0
    for trial in range(12):
        feats, toks = torch.randn(5, 32, generator=g), torch.randint(0, 50, (5,), generator=g)
        cache = head.new_cache(100)
        last = extend(head, cache, feats, toks)
        base = TreeParams(4, 4, 30)
        scores = expand(head, cache, last, base).scores
        # a stop between two candidates' scores (well away from both: fewer rows per head step round
        # differently in the last bits), cutting inside levels
        ranked = scores.sort(descending=True).values
        j = [3, 6, 10, 16][trial % 4]
        while float(ranked[j] - ranked[j + 1]) < 1e-3:
            j += 1
        stop = float(ranked[j] + ranked[j + 1]) / 2
        pruned = TreeParams(4, 4, 30, stop_logprob=stop)
        rows_fed.clear()
        cand = tree_mod.expand(head, cache, last, pruned)
        pruned_rows, levels = sum(rows_fed), len(rows_fed)
        got = rerank(cand, 7, pruned, False)
        rows_fed.clear()
        full = tree_mod.expand(head, cache, last, TreeParams(4, levels, 30))  # every branch, same levels
        assert sum(rows_fed) == 4 * levels
        want = rerank(full, 7, pruned, False)
        for name in ("tokens", "parents", "depths", "mask", "paths"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (trial, name)
        assert torch.allclose(got.scores, want.scores, atol=1e-5)
        assert pruned_rows <= 4 * levels and cache.length == 5
        fewer += pruned_rows < 4 * levels
    assert fewer >= 6, "the stop prunes branches inside a level, not only whole levels"


def test_bad_inputs_are_named():
    with pytest.raises(InvalidRequest, match="ascend"):
        CostCurve((2, 1), (0.1, 0.2))
    with pytest.raises(InvalidRequest, match="stop_logprob"):
        TreeParams(1, 1, 3, stop_logprob=0.5)


def test_cost_curve_interpolates():
    c = CostCurve((1, 4, 8), (1.0, 2.0, 4.0))
    assert [c(0), c(1), c(2.5), c(6), c(12)] == pytest.approx([1.0, 1.0, 1.5, 3.0, 6.0])
