"""Detaching the drafter while the budget picks plain steps: those rounds are Decode calls that keep
their features on the verifier (no draft call, no features sent), and the round before the next
probe (or a tree the load brings back) verifies the root alone, whose answer carries every kept row.
The tokens are exactly those of the attached engine (greedy and seeded sampling, EAGLE-2 and
EAGLE-3), greedy equals plain decoding, and every committed row reaches the drafter exactly once.
Real tiny models; the counts of calls show the detach really happens."""

from __future__ import annotations

import threading

import pytest
import torch

from services.engine.batched import BatchedDrafter, BatchedVerifier
from services.engine.batcher import BatchLimits
from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import DecodeCall, Verifier, VerifyCall
from services.spec.acceptance import REALIZED_MAX, REALIZED_MIN, prior_stats
from services.spec.budget import Budget
from services.spec.cost import CostCurve, CostModel
from services.spec.load_board import LoadBoard
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams, root_tree
from tests.helpers import VOCAB

LARGEST = TreeParams(4, 3, 12)
ROWS = (1, 2, 4, 8, 16, 32, 64)
VERIFY = CostCurve(ROWS, tuple(1 + 0.08 * (r - 1) for r in ROWS))
# a draft head that costs more than it can win: plain steps, and a probe every `probe_every` rounds
PLAIN_WINS = CostModel(VERIFY, CostCurve((1, 16), (50.0, 60.0)), CostCurve((1, 16), (50.0, 60.0)))
# drafts at a fifth of a forward: trees and plain steps alternate with the acceptance and the load
MIXED = CostModel(VERIFY, CostCurve((1, 16), (0.2, 0.3)), CostCurve((1, 16), (0.2, 0.4)))
PROMPT = (5, 17, 99, 3, 42, 8, 61)


class CountingVerifier(Verifier):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: dict[str, int] = {"decode_keep": 0, "decode": 0, "verify": 0}

    def run(self, calls):
        for c in calls:
            if isinstance(c, DecodeCall):
                self.calls["decode_keep" if c.keep_features else "decode"] += 1
            elif isinstance(c, VerifyCall):
                self.calls["verify"] += 1
        return super().run(calls)


class CountingDrafter(Drafter):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drafts = 0
        self.rows = 0  # committed rows sent (tokens and features, checked equal)

    def draft_many(self, calls):
        for c in calls:
            assert c.tokens.shape[0] == c.features.shape[0], (c.tokens.shape, c.features.shape)
            self.drafts += 1
            self.rows += int(c.tokens.shape[0])
        return super().draft_many(calls)


def budget(costs: CostModel, detach: bool, probe_every: int, board: LoadBoard | None = None) -> Budget:
    # probes every `probe_every` rounds unconditionally (no back-off, no check that a probe could
    # pay): the rounds around each probe are what these tests exercise
    return Budget(costs, prior_stats({"top1_agreement": 0.5}), largest=LARGEST, probe_every=probe_every,
                  detach=detach, load=board, probe_accept=None, probe_backoff=1)


def run(engine: Engine, req: GenerationRequest) -> tuple[list[int], list]:
    steps = list(engine.generate(req))
    return [t for s in steps for t in s.tokens], [s.stats for s in steps]


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
@pytest.mark.parametrize("costs", [PLAIN_WINS, MIXED], ids=["plain_wins", "mixed"])
def test_detached_rounds_give_the_attached_tokens(pair, costs, request) -> None:
    _, target, head = request.getfixturevalue(pair)
    kind = head.feature_kind
    plain = Engine(Verifier(target, "none"), None, 512, VOCAB)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)):
        for probe_every in (3, 6):
            req = GenerationRequest(PROMPT, 40, sampling, ignore_eos=True)
            attached = Engine(Verifier(target, kind), Drafter(head, LARGEST), 512, VOCAB,
                              budget=budget(costs, False, probe_every))
            v, d = CountingVerifier(target, kind), CountingDrafter(head, LARGEST)
            detached = Engine(v, d, 512, VOCAB, budget=budget(costs, True, probe_every))
            want, want_stats = run(attached, req)
            got, stats = run(detached, req)
            label = f"{sampling}, probe_every={probe_every}"
            assert got == want, label
            assert [s.tree_size for s in stats] == [s.tree_size for s in want_stats], label  # the same trees
            if sampling.greedy:
                assert got == run(plain, req)[0], label
            n_detached = sum(s.detached for s in stats)
            assert v.calls["decode_keep"] == n_detached and v.calls["decode"] == 0
            assert v.calls["verify"] == len(stats) - 1 - n_detached  # every other round verifies a tree
            drafting = sum(s.tree_size > 1 for s in stats[1:])
            assert d.drafts == drafting  # no draft call in a plain round
            if costs is PLAIN_WINS:
                assert drafting >= 3 and n_detached >= (len(stats) - 1) * (probe_every - 2) // probe_every, label
            else:
                assert n_detached > 0 and drafting > 0, label
            # every committed row up to the last draft reached the drafter exactly once: its KV
            # holds as many rows as were sent (+ nothing lost, nothing twice)
            assert d.rows <= len(PROMPT) + len(got) - 1


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_detached_rounds_in_plain_runs_give_the_attached_tokens(pair, request) -> None:
    """The in-process plain runs (services/engine/plain_run.py: each step queued before the previous
    token is read, features kept per step) inside detached stretches: the attached engine's tokens
    and trees, greedy and sampled (step by step), with runs really used."""
    _, target, head = request.getfixturevalue(pair)
    kind = head.feature_kind
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)):
        req = GenerationRequest(PROMPT, 40, sampling, ignore_eos=True)
        attached = Engine(Verifier(target, kind), Drafter(head, LARGEST), 512, VOCAB,
                          budget=budget(PLAIN_WINS, False, 6))
        v = CountingVerifier(target, kind)
        runs = Engine(v, Drafter(head, LARGEST), 512, VOCAB, budget=budget(PLAIN_WINS, True, 6), plain_run=4)
        want, want_stats = run(attached, req)
        got, stats = run(runs, req)
        assert got == want and [s.tree_size for s in stats] == [s.tree_size for s in want_stats], sampling
        assert v.calls["decode_keep"] == sum(s.detached for s in stats) > 0
        assert sum(s.run for s in stats) > 0, "no round read its token from a run"


def test_kept_features_are_the_attached_rounds_features(llama_pair) -> None:
    """Decode(keep_features) x3 then a Verify returns the same feature rows, in order, as four
    root-only Verify rounds; a Decode without it keeps nothing."""
    _, target, _ = llama_pair
    v = Verifier(target, "hidden")
    prompt = torch.tensor(PROMPT)
    a = v.prefill("a", prompt, SamplingParams(), 64).first_token
    b = v.prefill("b", prompt, SamplingParams(), 64).first_token
    assert a == b
    attached = []
    for r in range(1, 5):
        out = v.verify("a", root_tree(a), r)
        attached.append(out.features)
        a = out.acceptance.new_tokens[-1]
    for r in range(1, 4):
        b = v.decode("b", b, r, keep_features=True)
    last = v.verify("b", root_tree(b), 4)
    assert last.acceptance.new_tokens[-1] == a
    assert torch.equal(last.features, torch.cat(attached))
    c = v.prefill("c", prompt, SamplingParams(), 64).first_token
    c = v.decode("c", c, 1)
    assert v.verify("c", root_tree(c), 2).features.shape[0] == 1


def test_detach_in_a_batch_gives_the_batch1_tokens(llama_pair) -> None:
    """Several adaptive sequences sharing a load board and batched forwards detach and re-attach at
    different rounds; each gets its batch-1 tokens (greedy: plain decoding's)."""
    _, target, head = llama_pair
    reqs = [GenerationRequest(PROMPT[: 3 + i], 12 + 5 * i, SamplingParams() if i % 2 == 0 else
                              SamplingParams(temperature=0.8, seed=i), ignore_eos=True) for i in range(6)]
    solo = [run(Engine(Verifier(target, head.feature_kind), Drafter(head, LARGEST), 512, VOCAB,
                       budget=budget(MIXED, False, 4, LoadBoard())), r)[0] for r in reqs]
    counting = CountingVerifier(target, head.feature_kind)
    bv = BatchedVerifier(counting, BatchLimits(max_batch=6))
    bd = BatchedDrafter(Drafter(head, LARGEST), BatchLimits(max_batch=6))
    engine = Engine(bv, bd, 512, VOCAB, budget=budget(MIXED, True, 4, LoadBoard()))
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, run(engine, reqs[i])[0])) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bv.close()
    bd.close()
    for i, r in enumerate(reqs):
        if r.sampling.greedy:
            assert got[i] == solo[i], i
        else:  # a seeded sequence's plans do not depend on the load: the same trees, the same tokens
            assert got[i] == solo[i], i
    assert counting.calls["decode_keep"] > 0


def test_a_tree_that_the_load_brings_back_waits_one_round_for_the_kept_features(llama_pair) -> None:
    """A greedy sequence detached under load (others' rows make its trees cost more than they
    win) sees the load go: its next planned tree first gets a root-only Verify round (bringing the
    kept rows' features), then drafts with every row in place; the tokens stay plain decoding's."""
    _, target, head = llama_pair
    board = LoadBoard()
    v, d = CountingVerifier(target, head.feature_kind), CountingDrafter(head, LARGEST)
    # a forward nearly flat up to 8 rows, then compute-bound: trees pay alone, not beside 60 rows
    costs = CostModel(CostCurve(ROWS, (1.0, 1.01, 1.03, 1.07, 1.5, 3.0, 6.0)), CostCurve((1, 16), (0.02, 0.03)),
                      CostCurve((1, 16), (0.02, 0.04)))
    engine = Engine(v, d, 512, VOCAB, budget=budget(costs, True, 100, board))
    req = GenerationRequest(PROMPT, 30, SamplingParams(), ignore_eos=True)
    board.post("others", 60.0, 60.0, 0.0)  # a heavy batch: every row of this sequence is expensive
    stats, tokens = [], []
    for step in engine.generate(req):
        stats.append(step.stats)
        tokens += step.tokens
        if len(stats) == 8:
            board.leave("others")  # the load goes
    plain = Engine(Verifier(target, "none"), None, 512, VOCAB)
    assert tokens == run(plain, req)[0]
    kinds = ["detached" if s.detached else "tree" if s.tree_size > 1 else "root" for s in stats[1:]]
    assert kinds[:6] == ["detached"] * 6, kinds
    assert "tree" in kinds, kinds
    first_tree = kinds.index("tree")
    assert kinds[first_tree - 1] == "root", kinds  # the catch-up round before the first tree
    assert d.drafts == kinds.count("tree")


def test_realized_gain_carries_to_the_next_greedy_sequence_but_not_to_a_seeded_one(llama_pair) -> None:
    """A greedy sequence that drafted leaves its measured realized share on the engine and the load
    board, where the next greedy sequence starts; a seeded sampling sequence starts from the prior,
    so it draws the same trees and tokens on a used engine as on a fresh one."""
    _, target, head = llama_pair
    board = LoadBoard()

    def engine() -> Engine:
        return Engine(Verifier(target, head.feature_kind), Drafter(head, LARGEST), 512, VOCAB,
                      budget=budget(MIXED, True, 4, board))

    used = engine()
    greedy = GenerationRequest(PROMPT, 30, SamplingParams(), ignore_eos=True)
    tokens, stats = run(used, greedy)
    assert any(s.tree_size > 1 for s in stats[1:])
    assert used.realized != 1.0 and board.realized == used.realized
    used.realized = board.realized = REALIZED_MIN  # as if the head's gains had rarely come true
    again, again_stats = run(used, greedy)
    assert again == tokens  # greedy: the same tokens whatever the budget learned
    drafting = sum(s.tree_size > 1 for s in stats[1:])
    assert sum(s.tree_size > 1 for s in again_stats[1:]) < drafting  # it started from the learned share
    used.realized = board.realized = REALIZED_MAX  # and as if they had come true beyond the model's
    seeded = GenerationRequest(PROMPT, 30, SamplingParams(temperature=0.9, seed=3), ignore_eos=True)
    board_fresh = LoadBoard()
    fresh = Engine(Verifier(target, head.feature_kind), Drafter(head, LARGEST), 512, VOCAB,
                   budget=budget(MIXED, True, 4, board_fresh))
    want, want_stats = run(fresh, seeded)
    got, got_stats = run(used, seeded)
    assert got == want and [s.tree_size for s in got_stats] == [s.tree_size for s in want_stats]


def test_a_sequence_is_on_the_load_board_from_its_prefill(llama_pair) -> None:
    _, target, head = llama_pair
    board = LoadBoard()
    e = Engine(Verifier(target, head.feature_kind), Drafter(head, LARGEST), 512, VOCAB,
               budget=budget(MIXED, True, 4, board))
    steps = e.generate(GenerationRequest(PROMPT, 6, SamplingParams(), ignore_eos=True), "s1")
    assert "s1" not in board.rows()
    next(steps)  # the prefill ran
    assert "s1" in board.rows()
    list(steps)
    assert "s1" not in board.rows()
