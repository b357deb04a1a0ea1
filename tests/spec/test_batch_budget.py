"""The load-adaptive budget: alone a sequence gets the batch-1 choice; joining a batch whose forward
is already compute-bound, the same statistics choose a smaller tree, down to a plain step; the load
board tracks each sequence's latest plan. (Lossless whatever it picks: tests/engine/test_batching.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.spec.acceptance import prior_stats
from services.spec.budget import AUTO_LARGEST, Budget
from services.spec.cost import CostCurve, CostModel
from services.spec.load_board import Load, LoadBoard, same_load

ROWS = (1, 2, 4, 8, 16, 32, 64)


def budget(board: LoadBoard | None, fixed: float = 1.0, per_row: float = 0.05) -> Budget:
    costs = CostModel(CostCurve(ROWS, tuple(fixed + per_row * (r - 1) for r in ROWS)),
                      CostCurve((1, 16), (0.001, 0.004)), CostCurve((1, 16), (0.002, 0.01)))
    return Budget(costs, prior_stats({"top1_agreement": 0.8}), largest=AUTO_LARGEST, load=board)


def rows(plan) -> int:
    return (plan.tree.size if plan.tree is not None else 1) + plan.chain


def test_alone_the_batch_budget_is_the_batch1_budget() -> None:
    board = LoadBoard()
    b = budget(board)
    alone = budget(None).plan(b.new_stats())
    with_board = b.plan(b.new_stats(), key="s0")
    assert with_board == alone and alone.tree is not None and rows(alone) > 4
    assert board.rows() == {"s0": rows(alone)}


def test_a_compute_bound_batch_shrinks_trees_down_to_plain() -> None:
    board = LoadBoard()
    b = budget(board)
    stats = b.new_stats()
    alone = b.plan(stats, key="me")
    sizes = []
    for others in (1, 4, 16, 64):
        for i in range(others):
            board.post(f"o{i}", 1.0, 1.0, 0.0)  # plain decoders sharing the forward
        plan = b.plan(stats, key="me")
        sizes.append(rows(plan))
        load = board.others("me")
        assert load.sequences == others and load.rows == others
    assert sizes[0] <= rows(alone)
    assert sizes == sorted(sizes, reverse=True), sizes
    assert sizes[-1] == 1, sizes  # 64 plain rows already make the forward compute-bound: no tree pays
    board.leave("me")
    assert "me" not in board.rows()


def test_a_memory_bound_forward_keeps_trees_under_load() -> None:
    """A forward whose time hardly grows with rows (a GPU-like curve): trees stay worth it."""
    board = LoadBoard()
    b = budget(board, fixed=1.0, per_row=0.0005)
    for i in range(16):
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    plan = b.plan(b.new_stats(), key="me")
    assert plan.tree is not None and rows(plan) > 4


def test_sampling_sequences_keep_the_batch1_choice_but_count_in_the_load() -> None:
    """adapt=False (a seeded sampling sequence): the shape does not depend on the load, so its seed
    replays the same tokens; its plan is still posted for the others."""
    board = LoadBoard()
    b = budget(board)
    for i in range(64):
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    alone = budget(None).plan(b.new_stats())
    plan = b.plan(b.new_stats(), key="sampler", adapt=False)
    assert plan.tree == alone.tree and plan.tokens == alone.tokens
    assert board.rows()["sampler"] == rows(alone)
    assert rows(b.plan(b.new_stats(), key="greedy")) == 1  # a greedy one adapts


def test_a_flat_stretch_of_a_noisy_curve_does_not_make_batch_rows_free() -> None:
    """The default model's curve as measured on a busy machine (flat from 3 to 16 rows: a disturbed
    point raised by the non-decreasing fix). With three plain neighbours the flat stretch would make
    12 extra rows look free (a 16-node tree); each row still costs the curve's top slope, so only a
    tree whose few nodes pay for that is chosen."""
    counts = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    secs = (0.0467, 0.0666, 0.1328, 0.1328, 0.1328, 0.1328, 0.1328, 0.1328, 0.1468, 0.1665, 0.2300, 0.2699)
    costs = CostModel(CostCurve(counts, secs), CostCurve((1, 16), (0.0008, 0.0013)),
                      CostCurve((1, 16), (0.0004, 0.0009)))
    board = LoadBoard()
    b = Budget(costs, prior_stats({"top1_agreement": 0.25}), largest=AUTO_LARGEST, load=board)
    for i in range(3):
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    assert b.plan(b.new_stats()).tree is None  # alone: a plain step
    assert rows(b.plan(b.new_stats(), key="me")) <= 4


# ---- the batch-level policy: measured latencies, the margin under load, probes -------------------


def flat(a: float, b: Budget):
    s = b.new_stats()
    s.depth = [a] * len(s.depth)
    s.confidence = a
    return s


def with_extras(board: LoadBoard, draft: float = 0.0, verify: float = 0.0) -> LoadBoard:
    board.observe_draft(draft)
    board.observe_verify(verify)
    return board


def test_a_measured_draft_latency_is_charged_to_drafting_shapes() -> None:
    """Alone, acceptance 0.5 pays for a tree when a draft costs what the model says; when the
    services' draft round trip is measured at twice a forward, no tree pays and the choice is plain."""
    b = budget(LoadBoard())
    assert b.plan(flat(0.5, b), key="me").tree is not None
    slow = budget(with_extras(LoadBoard(), draft=2.0))
    assert slow.plan(flat(0.5, slow), key="me").tree is None


def test_a_measured_verify_latency_dilutes_the_cost_of_tree_rows() -> None:
    """Acceptance 0.3 and a draft extra of 0.4 s: against a 1 s forward a chain does not pay; when
    every verify call is measured 3 s longer than the modelled forward (round trips, batching), the
    same chain's extra rows and draft are a small share of the round and it pays."""
    b = budget(with_extras(LoadBoard(), draft=0.4))
    assert b.plan(flat(0.3, b), key="me").tree is None
    b = budget(with_extras(LoadBoard(), draft=0.4, verify=3.0))
    assert b.plan(flat(0.3, b), key="me").tree is not None


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_under_load_a_draft_must_beat_plain_by_the_margin() -> None:
    """With three plain neighbours: for each measured draft extra, the margin-0 chooser's best draft
    beats plain by some ratio; where that ratio is below 1.05 the default margin (0.05) keeps the
    batch plain, where it is above it drafts. Alone, no margin applies."""
    seen_small = seen_large = False
    for i in range(200):
        extra = 0.002 * i
        board = with_extras(LoadBoard(), draft=extra)
        for j in range(3):
            board.post(f"o{j}", 1.0, 1.0, 0.0)
        no_margin = budget(board)
        no_margin = Budget(no_margin.costs, no_margin.prior, largest=AUTO_LARGEST, load=board, load_margin=0.0)
        p = no_margin.plan(flat(0.5, no_margin), key="me")
        if p.tree is None:
            continue
        load = board.others("me")
        plain_rate = (load.tokens + 1.0) / (no_margin.costs.t_verify(4) + load.verify_extra)
        ratio = (load.tokens + p.tokens) / p.seconds / plain_rate
        margin = Budget(no_margin.costs, no_margin.prior, largest=AUTO_LARGEST, load=board)  # default 0.05
        chosen = margin.plan(flat(0.5, margin), key="me")
        if ratio < 1.05:
            seen_small = True
            assert chosen.tree is None, (extra, ratio)
        else:
            seen_large = True
            assert chosen.tree is not None, (extra, ratio)
    assert seen_small and seen_large
    alone = budget(with_extras(LoadBoard(), draft=0.3))
    alone_no_margin = Budget(alone.costs, alone.prior, largest=AUTO_LARGEST, load=alone.load, load_margin=0.0)
    assert alone.plan(flat(0.5, alone), key="me") == alone_no_margin.plan(flat(0.5, alone_no_margin), key="me")


def test_probes_stop_where_even_good_acceptance_could_not_pay() -> None:
    """64 plain neighbours make the forward compute-bound: a probe could not change the choice even
    at acceptance 0.8, so none runs (each one would delay the whole batch). Alone, the same
    statistics probe, and `probes_next` announces every probe one round ahead (the engine attaches
    the drafter for it) and no other round."""
    board = LoadBoard()
    b = budget(board, per_row=0.2)
    for i in range(64):
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    s = flat(0.05, b)
    assert not any(b.plan(s, key="me").drafts for _ in range(200))
    alone = budget(LoadBoard(), per_row=0.2)
    s = flat(0.05, alone)
    drafted, announced = [], []
    for _ in range(200):
        drafted.append(alone.plan(s, key="me").drafts)
        announced.append(alone.probes_next(s))
    assert sum(drafted) >= 3
    assert drafted[1:] == announced[:-1]


def extras(board: LoadBoard) -> tuple[float, float]:
    """(draft extra, verify extra) as a plan sees them: a key nobody posted sees every sequence."""
    load = board.others("not-a-sequence")
    return load.draft_extra, load.verify_extra


def test_the_board_keeps_the_median_of_recent_excess_latency() -> None:
    board = LoadBoard(window=3, decay=0.5 / 16)
    assert extras(board) == (0.0, 0.0)
    board.observe_draft(0.02)
    board.observe_draft(0.04)
    assert abs(extras(board)[0] - 0.03) < 1e-12  # (two observations: their mean)
    board.observe_verify(-0.01)  # faster than the model: no negative extra (the draft extra decays)
    assert extras(board)[1] == 0.0 and abs(extras(board)[0] - 0.03 * (1 - 0.5 / 16)) < 1e-12
    b = budget(board)
    p = AUTO_LARGEST
    b.observe_draft(p, 4, b.costs.draft_seconds(p, 4) + 0.07)  # the excess over the model is observed
    assert abs(extras(board)[0] - 0.04 * (1 - 0.5 / 16)) < 1e-9  # median of 0.02, 0.04 (decayed) and 0.07
    plan = b.plan(b.new_stats(), key="me")
    b.observe_verify(plan, plan.verify_s + 0.01)
    assert abs(extras(board)[1] - 0.0) < 1e-9  # median of -0.01 and 0.01
    b.observe_verify(plan, plan.verify_s + 0.02)
    assert abs(extras(board)[1] - 0.01) < 1e-9  # an observation below 0 still counts in the median
    # rounds without drafts forget the draft extra slowly (its observations shrink by `decay` a call)
    before = extras(board)[0]
    for _ in range(32):
        board.observe_verify(0.0)
    assert abs(extras(board)[0] - before * (1 - 0.5 / 16) ** 32) < 1e-12


def test_one_slow_round_does_not_make_the_budget_plain() -> None:
    """A service's first draft (cold) or the first Verify after a closed run (it waits for the run's step
    in flight) costs far more than a steady round's extra: one such round leaves the plan drafting, the
    second steady round after it erases it; a steady shift (every round that slow) turns it plain (the
    board before, an EMA of weight 0.1, charged every tree 1.6 s of that one draft two rounds later)."""
    b = budget(LoadBoard())
    s = flat(0.5, b)
    p = AUTO_LARGEST
    steady = b.costs.draft_seconds(p, 2) + 0.001
    b.observe_draft(p, 2, steady + 2.0)  # the cold first draft: 2 s beyond the model
    b.observe_draft(p, 2, steady)
    b.observe_draft(p, 2, steady)
    assert extras(b.load)[0] < 0.01 and b.plan(s, key="me").tree is not None
    for _ in range(6):
        b.observe_draft(p, 2, steady + 2.0)  # every draft that slow now
    assert extras(b.load)[0] > 1.9 and b.plan(s, key="me").tree is None


def test_an_unchanged_round_reuses_the_choice_and_a_changed_one_does_not() -> None:
    """A steady batch (same statistics, same load) is not planned again; new acceptance or a new load
    is (the memo's key holds both)."""
    board = LoadBoard()
    b = budget(board)
    for i in range(3):
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    s = flat(0.5, b)
    first = b.plan(s, key="me")
    memo = s.memo
    assert b.plan(s, key="me") == first and s.memo is memo  # reused
    s.depth = [0.02] * len(s.depth)  # acceptance collapsed: plain now
    assert first.tree is not None and b.plan(s, key="me").tree is None and s.memo is not memo
    s.depth = [0.5] * len(s.depth)
    assert b.plan(s, key="me").tree is not None
    for i in range(3, 64):  # a compute-bound batch: plain
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    assert b.plan(s, key="me").tree is None
    # measured extras that move by less than 10% are the same batch; more is a new one
    base = Load(3, 3.0, 3.0, 0.0, 0.010, 0.050)
    assert same_load(base, replace(base, verify_extra=0.054)) and same_load(base, replace(base, draft_s=0.0004))
    assert not same_load(base, replace(base, verify_extra=0.060)) and not same_load(base, replace(base, rows=4.0))
    assert not same_load(base, replace(base, sequences=4)) and not same_load(base, replace(base, draft_extra=0.02))


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_the_search_bound_never_changes_a_choice_and_skips_under_load(monkeypatch) -> None:
    """`_eagle_bound` lets `_choose` skip the tree search when no shape can beat plain: on random
    statistics, curves (not monotone) and loads the choice equals the full search's; under a
    compute-bound batch the bound is below the plain rate (the skip happens)."""
    import math
    import random

    import services.spec.budget as budget_mod
    from services.spec.budget import AUTO_LARGEST

    rng = random.Random(7)
    full = lambda *a: math.inf  # noqa: E731 - the search always runs
    for _ in range(300):
        base, per = rng.uniform(0.01, 0.1), rng.uniform(1e-4, 1e-2)
        costs = CostModel(CostCurve(ROWS, tuple(base + per * (r - 1) * rng.uniform(0.7, 1.3) for r in ROWS)),
                          CostCurve((1, 16), (rng.uniform(1e-4, 5e-3), rng.uniform(5e-3, 2e-2))),
                          CostCurve((1, 16), (rng.uniform(1e-4, 5e-3), 0.01)))
        b = Budget(costs, prior_stats({"top1_agreement": rng.uniform(0.05, 0.95)}), largest=AUTO_LARGEST,
                   chain_limit=rng.choice([0, 8]))
        stats = b.new_stats()
        stats.depth = [min(1.0, a * rng.uniform(0.5, 1.5)) for a in stats.depth]
        stats.rank = [rng.uniform(0.0, 0.5) for _ in stats.rank]
        n = rng.choice([0, 0, 1, 3, 8, 15])
        load = Load(n, n * rng.choice([1, 2, 5]), n * rng.uniform(1, 2), rng.uniform(0, 0.01),
                    rng.uniform(0, 0.02), rng.uniform(0, 0.02)) if n else Load()
        chain = rng.choice([0, 3, 8])
        fast = b._choose(stats, chain, 2.0, load)
        with monkeypatch.context() as m:
            m.setattr(budget_mod, "_eagle_bound", full)
            slow = b._choose(stats, chain, 2.0, load)
        assert fast[:2] == slow[:2]
    b = budget(None, per_row=0.2)  # 15 plain rows already make the forward compute-bound
    stats = b.new_stats()
    load = Load(15, 15.0, 15.0)
    best, _, tv, gains = b._choose(stats, 0, 2.0, load)
    c = b.costs
    bound = budget_mod._eagle_bound(stats, c, b.largest, c.head(2.0) + c.logits(1), tv, gains, (0,), 15.0)
    assert best.tree is None and bound <= (15.0 + best.tokens) / best.seconds * (1 + b.load_margin)


def test_rows_the_draft_kv_has_not_seen_are_charged_only_in_a_batch() -> None:
    """Alone, the pending rows (a prompt before the first draft, rounds spent detached) are a sunk
    cost: the plan is the same whatever their number. With others in the forward, the draft that
    catches them up delays everyone and a plain sequence never pays them: enough of them make the
    plan plain."""
    alone = budget(LoadBoard(), per_row=0.0005)
    stats = alone.new_stats()
    assert alone.plan(stats, key="me", pending_rows=5000).tree == alone.plan(stats, key="me").tree is not None
    board = LoadBoard()
    b = budget(board, per_row=0.0005)
    for i in range(4):
        board.post(f"o{i}", 1.0, 1.0, 0.0)
    assert b.plan(b.new_stats(), key="me", pending_rows=100).tree is not None
    assert b.plan(b.new_stats(), key="me", pending_rows=5000).tree is None


def test_a_sequence_joins_the_board_before_its_first_plan() -> None:
    """Sequences that start together see each other from their first plan on: a joined sequence
    counts as one plain step; its own plan replaces that, leaving removes it."""
    board = LoadBoard()
    board.join("a")
    board.join("b")
    assert board.others("a") == Load(1, 1.0, 1.0, 0.0)
    board.post("b", 5.0, 1.8, 0.01)
    board.join("b")  # a late join does not overwrite a plan
    assert board.rows() == {"a": 1.0, "b": 5.0}
    board.leave("b")
    assert board.others("a").sequences == 0


def test_plain_rounds_and_tree_rounds_measure_their_own_extra() -> None:
    """Through the services a plain round is a Decode (the verifier chains them in plain runs) and a
    tree round a call of its own: the board keeps their latencies apart, a plain step is charged the
    plain rounds' extra once one was measured (the tree rounds' before), and trees the tree rounds'."""
    board = LoadBoard(window=1)
    b = budget(board)
    s = b.new_stats()
    board.observe_draft(0.004)
    board.observe_verify(5.0)  # tree rounds: 5 s beyond the modelled forward of about 1 s
    assert board.others("me").plain_extra is None
    assert b.plan(s, key="me").tree is not None  # a plain step charged the same 5 s: a tree still pays
    board.observe_plain(0.0)  # plain rounds: nothing beyond the model
    load = board.others("me")
    assert (load.plain_extra, load.verify_extra) == (0.0, 5.0) and load.draft_extra < 0.004  # (decays here too)
    plain = b.plan(s, key="me")
    assert plain.tree is None and plain.chain == 0  # a plain step at ~1 s beats any tree at 6 s and more
    b.observe_verify(plain, plain.verify_s + 0.2)  # a plain plan's round feeds the plain extra only
    after = board.others("me")
    assert abs(after.plain_extra - 0.2) < 1e-9 and after.verify_extra == 5.0
    assert not same_load(load, replace(load, plain_extra=None))
