"""Drafting inside the Verify (Engine, "Drafting inside the Verify"): a verifier role that drafts too
gets each tree round's next shape with the Verify and returns the next tree with the verdict; the
engine uses it cut to the budget's next plan, or leaves it for a plain round. In process here (the
coordinator's placement makes the same calls over gRPC: tests/coordinator/test_colocated.py), with a
scripted budget whose plans change every round: greedy output equals transformers' token for token,
and each drafted tree is counted once as kept, trimmed or unused. With runs of tree rounds (a verifier
that computes rounds ahead of the engine, as VerifyRun does), plans that change the shape never make
the engine send another tree for a round the run verified already (held rounds), and the output
stays the target's."""

from dataclasses import dataclass, field, replace

import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.acceptance import prior_stats
from services.spec.budget import Budget, RoundPlan
from services.spec.cost import CostCurve, CostModel
from services.spec.overlap import AheadPolicy
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, InProcessPlainRun, hf_greedy

LARGE = TreeParams(4, 3, 16)
SMALL = TreeParams(2, 2, 5)
SCRIPT = (LARGE, LARGE, SMALL, None, LARGE, SMALL, SMALL, LARGE)  # None: a plain round
PROMPT = [5, 17, 99, 3, 42, 8, 17, 99]


class DraftingVerifier:
    """A verifier that drafts too, in process: after the verdict, the Draft the engine would send next
    (the accepted tokens and the bonus, their features), in the shape it asked for."""

    def __init__(self, verifier: Verifier, drafter: Drafter) -> None:
        self.verifier, self.drafter = verifier, drafter
        self.drafted = 0

    def __getattr__(self, name):
        return getattr(self.verifier, name)

    def drafts_next(self, seq_id: str) -> bool:
        return True

    def verify(self, seq_id, tree, round_index, next_draft: TreeParams | None = None):
        res = self.verifier.verify(seq_id, tree, round_index)
        if next_draft is None:
            return res
        self.drafted += 1
        tokens = torch.tensor(res.acceptance.new_tokens)
        return replace(res, next_tree=self.drafter.draft(seq_id, tokens, res.features, next_draft), next_draft_s=1e-3)


@dataclass(frozen=True)
class ScriptedBudget(Budget):
    """Plans `script` round after round (the prefill's plan included), whatever was accepted."""
    count: list = field(default_factory=lambda: [0])
    script: tuple = SCRIPT

    def plan(self, stats, chain=0, commit_rows=2.0, key=None, adapt=True, pending_rows=0) -> RoundPlan:
        tree = self.script[self.count[0] % len(self.script)]
        self.count[0] += 1
        return RoundPlan(tree, 0, 1.0 + (tree.size if tree else 0) / 8, 1.0)


def costs() -> CostModel:
    rows = (1, 64)
    return CostModel(CostCurve(rows, (1.0, 2.0)), CostCurve((1, 16), (0.02, 0.05)), CostCurve((1, 16), (0.03, 0.2)))


def test_plans_that_change_every_round_keep_trim_or_leave_the_drafted_tree(llama_pair):
    hf, target, head = llama_pair
    drafter = Drafter(head, LARGE)
    verifier = DraftingVerifier(Verifier(target, head.feature_kind), drafter)
    budget = ScriptedBudget(costs(), prior_stats({"top1_agreement": 0.3}), largest=LARGE, detach=False)
    engine = Engine(verifier, drafter, 512, VOCAB, budget=budget)
    tokens, stats = [], []
    for step in engine.generate(GenerationRequest(tuple(PROMPT), 48)):
        tokens += step.tokens
        stats += [step.stats] if step.stats.round_index > 0 else []
    assert tokens == hf_greedy(hf, PROMPT, 48)
    counts = engine.verdict_counts
    assert counts["kept"] and counts["trimmed"] and counts["plain"]
    assert verifier.drafted == counts["kept"] + counts["trimmed"] + counts["plain"]
    inside = [s for s in stats if s.drafted_in_verify]
    assert len(inside) == counts["kept"] + counts["trimmed"]
    assert all(1 < s.tree_size <= LARGE.size for s in inside)
    # a round whose plan was SMALL verified at most SMALL's nodes, whichever way its tree was drafted
    assert any(1 < s.tree_size <= SMALL.size for s in inside)


def test_without_a_verifier_that_drafts_nothing_changes(llama_pair):
    """The same engine over a plain verifier role drafts after every verdict (no drafts_next)."""
    hf, target, head = llama_pair
    budget = Budget(costs(), prior_stats({"top1_agreement": 0.3}), largest=LARGE, fixed=LARGE)
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, LARGE), 512, VOCAB, budget=budget)
    steps = list(engine.generate(GenerationRequest(tuple(PROMPT), 24)))
    assert [t for s in steps for t in s.tokens] == hf_greedy(hf, PROMPT, 24)
    assert not any(s.stats.drafted_in_verify for s in steps) and not engine.verdict_counts


class PrefillDraftingVerifier(DraftingVerifier):
    """... which drafts round 1's tree inside its prefill too (the coordinator's placement does it over
    gRPC: VerifierPrefillRequest.next_draft), from the drafter the engine started: its Prefill's rows
    (prompt[1:] and the first token) with the prompt's features; the answer then has no features."""

    def __init__(self, verifier: Verifier, drafter: Drafter) -> None:
        super().__init__(verifier, drafter)
        self.asked: list[TreeParams | None] = []  # each prefill's first_draft

    def drafts_first(self, seq_id: str) -> bool:
        return True

    def prefill(self, seq_id, prompt, sampling, capacity, first_draft: TreeParams | None = None):
        pre = self.verifier.prefill(seq_id, prompt, sampling, capacity)
        self.asked.append(first_draft)
        if first_draft is None:
            return pre
        tokens = torch.cat([prompt[1:], torch.tensor([pre.first_token])])
        return replace(pre, features=pre.features[:0], next_tree=self.drafter.draft(seq_id, tokens, pre.features,
                                                                                  first_draft), next_draft_s=1e-3)


def test_round_one_is_drafted_in_the_prefill_as_planned_once(llama_pair):
    """Round 1 is planned before the prefill and its tree comes with it: the same plans, trees and
    acceptance round by round as the engine that drafts round 1 after the prefill (the budget asked
    once per round either way), the target's tokens; a plain first plan prefills without asking."""
    hf, target, head = llama_pair
    runs = {}
    for name, script in (("large", SCRIPT), ("plain", (None, *SCRIPT))):
        for role in (DraftingVerifier, PrefillDraftingVerifier):
            drafter = Drafter(head, LARGE)
            verifier = role(Verifier(target, head.feature_kind), drafter)
            budget = ScriptedBudget(costs(), prior_stats({"top1_agreement": 0.3}), largest=LARGE, detach=False,
                                    script=script)
            steps = list(Engine(verifier, drafter, 512, VOCAB, budget=budget).generate(GenerationRequest(tuple(PROMPT), 32)))
            assert [t for s in steps for t in s.tokens] == hf_greedy(hf, PROMPT, 32)
            runs[name, role] = ([(s.stats.tree_size, s.stats.accept_length) for s in steps], budget.count[0],
                                steps[1].stats.drafted_in_verify, getattr(verifier, "asked", None))
        before, after = runs[name, DraftingVerifier], runs[name, PrefillDraftingVerifier]
        assert after[:2] == before[:2]  # the same rounds, and as many plans
        assert not before[2] and after[2] == (name == "large")  # round 1's tree came with the prefill
        assert after[3] == [LARGE if name == "large" else None]


class RunningVerifier(DraftingVerifier):
    """A verifier that drafts too and runs tree rounds (verify_run) as the verifier service does: a
    run verifies each next tree in the run's shape, LOOKAHEAD rounds past the round the engine reads
    (it queues its next round before an answer goes out), and one more after it is closed (the round
    in flight when the cancel arrives). A round it computed is answered from it again, and the tree
    the engine sends for it must be the one the run verified."""

    LOOKAHEAD = 2

    def __init__(self, verifier: Verifier, drafter: Drafter) -> None:
        super().__init__(verifier, drafter)
        self.computed: dict[int, tuple] = {}  # round -> (the tree the run verified, its answer)
        self.runs: list[tuple[int, int]] = []  # (first round, rounds)
        self.answered_again = 0

    def verify(self, seq_id, tree, round_index, next_draft: TreeParams | None = None):
        if round_index in self.computed:
            verified, res = self.computed.pop(round_index)
            assert torch.equal(tree.tokens, verified.tokens) and torch.equal(tree.parents, verified.parents), \
                f"round {round_index}: the engine sent another tree than the run verified"
            self.answered_again += 1
            return res
        return super().verify(seq_id, tree, round_index, next_draft)

    def verify_run(self, seq_id, tree, round_index, next_params, rounds, max_tokens, stop_ids):
        self.runs.append((round_index, rounds))
        return _TreeRun(self, seq_id, tree, round_index, next_params, rounds, max_tokens, stop_ids)

    def decode_run(self, seq_id, token, round_index, steps, keep_features=False):
        return InProcessPlainRun(self.verifier, seq_id, token, round_index, steps, keep_features)


class _TreeRun:
    """One run of RunningVerifier (the placement's run interface: next, open, exhausted, close)."""

    def __init__(self, v: RunningVerifier, seq_id, tree, round_index, params, rounds, max_tokens, stop_ids) -> None:
        self.v, self.seq_id, self.params = v, seq_id, params
        self.tree, self.round = tree, round_index  # the next round the run computes, and its tree
        self.rounds, self.max_tokens, self.stop_ids = rounds, max_tokens, stop_ids
        self.made = self.count = self.read = 0
        self.ended, self.open = False, True

    def _step(self) -> None:
        if self.ended:
            return
        res = replace(DraftingVerifier.verify(self.v, self.seq_id, self.tree, self.round, self.params), from_run=True)
        self.v.computed[self.round] = (self.tree, res)
        new = res.acceptance.new_tokens
        self.made, self.count, self.round = self.made + len(new), self.count + 1, self.round + 1
        if (self.count >= self.rounds or self.made >= self.max_tokens or self.stop_ids & set(new)
                or res.next_tree is None):
            self.ended = True
        self.tree = res.next_tree

    def next(self, tree, round_index, next_params):
        while self.open and not self.ended and self.round <= round_index + RunningVerifier.LOOKAHEAD:
            self._step()
        if not self.open or round_index not in self.v.computed:  # the run ended before it: a single Verify
            self.open = False
            return self.v.verify(self.seq_id, tree, round_index, next_params)
        self.read += 1
        return self.v.verify(self.seq_id, tree, round_index)

    @property
    def exhausted(self) -> bool:
        return self.read >= self.rounds

    def close(self) -> None:
        if self.open:
            self._step()  # the round in flight when the cancel arrives
        self.open, self.ended = False, True


def test_runs_with_plans_that_change_hold_the_runs_trees(llama_pair):
    """The adaptive budget's plans change the shape in the middle of runs of tree rounds: the rounds a
    run may have verified already verify its trees as they are (held), then the plan applies; greedy
    output equals transformers' token for token, and every round a run computed is answered from it
    with the same tree (RunningVerifier checks)."""
    hf = llama_pair[0]
    script = (LARGE,) * 5 + (SMALL,) * 4 + (None,) * 2 + (SMALL, LARGE, LARGE)
    tokens, stats, engine, verifier = scripted_runs(llama_pair, script)
    assert tokens == hf_greedy(hf, PROMPT, 64)
    assert len(verifier.runs) > 1 and engine.verdict_counts["held"] and verifier.answered_again
    assert any(s.tree_run for s in stats) and not verifier.computed  # every round a run computed was used


def test_a_threshold_that_moves_every_round_keeps_the_run(llama_pair):
    """The adaptive budget moves the dynamic-depth threshold (stop_logprob) with every verdict while the
    shape stays: the run goes on in its first threshold (nothing held, one run until it is exhausted),
    every tree verified as the run drafted it (RunningVerifier checks), greedy output the target's. A
    shape change in the middle still holds (the control: the same script with one SMALL plan)."""
    hf = llama_pair[0]
    moving = tuple(replace(LARGE, stop_logprob=-1.0 - 0.37 * i) for i in range(7))
    for script, held in ((moving, False), (moving[:3] + (replace(SMALL, stop_logprob=-2.0),) + moving[3:], True)):
        tokens, stats, engine, verifier = scripted_runs(llama_pair, script)
        assert tokens == hf_greedy(hf, PROMPT, 64)
        assert bool(engine.verdict_counts["held"]) == held, engine.verdict_counts
        in_runs = sum(s.tree_run for s in stats)
        assert not verifier.computed  # every round a run computed was used
        if not held:  # each run gave all its 4 rounds (the last may end early: the request's end)
            assert in_runs >= 4 * (len(verifier.runs) - 1), (verifier.runs, in_runs)


def scripted_runs(llama_pair, script: tuple, n: int = 64):
    """Greedy generation of `n` tokens with plans scripted round by round, on RunningVerifier with runs
    of 4 -> (tokens, the rounds' stats, the engine, the verifier)."""
    _, target, head = llama_pair
    drafter = Drafter(head, LARGE)
    verifier = RunningVerifier(Verifier(target, head.feature_kind), drafter)
    budget = ScriptedBudget(costs(), prior_stats({"top1_agreement": 0.3}), largest=LARGE, detach=False, script=script)
    engine = Engine(verifier, drafter, 512, VOCAB, budget=budget, plain_run=4)
    tokens, stats = [], []
    for step in engine.generate(GenerationRequest(tuple(PROMPT), n)):
        tokens += step.tokens
        stats += [step.stats] if step.stats.round_index > 0 else []
    return tokens, stats, engine, verifier


def test_a_sampling_sequence_with_the_adaptive_budget_verifies_one_round_a_call(llama_pair):
    """Which rounds a closed run computed depends on timing (services), so a sampling sequence with the
    adaptive budget starts no run: each round one Verify that drafts the next tree, and a seed gives
    the same tokens again."""
    from services.spec.sampling import SamplingParams

    hf, target, head = llama_pair
    outs = []
    for _ in range(2):
        drafter = Drafter(head, LARGE)
        verifier = RunningVerifier(Verifier(target, head.feature_kind), drafter)
        budget = ScriptedBudget(costs(), prior_stats({"top1_agreement": 0.3}), largest=LARGE, detach=False,
                                script=(LARGE,) * 3 + (SMALL,) * 3)
        engine = Engine(verifier, drafter, 512, VOCAB, budget=budget, plain_run=4)
        req = GenerationRequest(tuple(PROMPT), 32, SamplingParams(0.9, seed=5))
        outs.append([t for step in engine.generate(req) for t in step.tokens])
        assert not verifier.runs and verifier.drafted > 3
    assert outs[0] == outs[1] and len(outs[0]) == 32


@dataclass
class ScriptedPolicy(AheadPolicy):
    """Drafts ahead (a guess of one token) at the choices numbered in `ahead_at` (from 1), not at the others:
    which rounds overlap is fixed, whatever the seconds."""
    ahead_at: frozenset = frozenset()

    def choose(self, draft_s, step_s, path_len, busy=0.0, chained=False, measured=False, sharing=1):
        self._choices += 1
        return 1 if self._choices in self.ahead_at and path_len else None

    @property
    def needs_baseline(self) -> bool:
        return False  # (it measures nothing)


def overlap_run(llama_pair, policy: AheadPolicy | None, n: int = 64):
    hf, target, head = llama_pair
    drafter = Drafter(head, LARGE)
    verifier = RunningVerifier(Verifier(target, head.feature_kind), drafter)
    budget = Budget(costs(), prior_stats({"top1_agreement": 0.3}), largest=LARGE, fixed=LARGE)
    engine = Engine(verifier, drafter, 512, VOCAB, budget=budget, ahead=policy, plain_run=4)
    tokens, stats = [], []
    for step in engine.generate(GenerationRequest(tuple(PROMPT), n)):
        tokens += step.tokens
        stats += [step.stats] if step.stats.round_index > 0 else []
    assert tokens == hf_greedy(hf, PROMPT, n)
    return stats, verifier


def test_rounds_that_do_not_draft_ahead_draft_inside_the_verify_and_run(llama_pair):
    """Drafting ahead with a verifier that drafts too (direct drafts, a colocated head): a round that
    drafts ahead verifies alone (its next tree is the ahead one or the engine's draft); the others
    draft inside the Verify and start runs of tree rounds, inside which nothing drafts ahead (the
    policy chooses again after the run). Greedy output stays the target's."""
    stats, verifier = overlap_run(llama_pair, ScriptedPolicy(ahead_at=frozenset({1, 3, 4, 7, 9, 12})))
    assert sum(s.ahead for s in stats) >= 4 and any(s.ahead_hit for s in stats)
    assert sum(s.drafted_in_verify for s in stats) >= 4 and verifier.runs and any(s.tree_run for s in stats)
    for before, after in zip(stats, stats[1:]):
        assert not (before.ahead and after.drafted_in_verify)  # an ahead round's next tree is not the Verify's
    assert not any(s.ahead and s.tree_run for s in stats)  # no ahead draft beside a run's rounds
    # the policy chose again once a run ended: an ahead draft after a run's round
    assert any(before.tree_run and after.ahead for before, after in zip(stats, stats[1:]))


def test_a_policy_that_never_drafts_ahead_runs_the_rounds_of_no_policy(llama_pair):
    """Overlap on but declined every round: the same rounds as without a policy (trees inside the
    Verify, runs), not the split rounds it made before drafting ahead and direct drafts combined."""
    with_policy, v1 = overlap_run(llama_pair, ScriptedPolicy())
    without, v2 = overlap_run(llama_pair, None)
    assert [(s.tree_size, s.accept_length, s.drafted_in_verify, s.tree_run) for s in with_policy] == \
        [(s.tree_size, s.accept_length, s.drafted_in_verify, s.tree_run) for s in without]
    assert v1.runs == v2.runs and sum(s.drafted_in_verify for s in without) > len(without) // 2


def test_a_learning_policy_measures_its_baseline_alone_then_drafts_ahead(llama_pair):
    """A policy that learns its costs drafts ahead only once it has measured a round's verify without an
    ahead draft. Beside a verifier that drafts too, that baseline round is one Verify (with its direct
    draft), not the start of a run: a run would keep the policy from choosing for up to plain_run
    rounds (a short request: all of them). Then it drafts ahead. (Its first choice after the baseline
    is count-based: contention 0 before any ahead round was measured.)"""
    stats, _ = overlap_run(llama_pair, AheadPolicy(contention=0.0))
    assert not stats[0].tree_run and not stats[0].ahead and stats[1].drafted_in_verify  # the baseline round
    assert stats[1].ahead


def test_a_runs_first_round_is_a_baseline_too(llama_pair):
    """A run's first round is a verify without an ahead draft (its later rounds may have been verified
    before the engine read them: no measurement): a policy that got no baseline elsewhere gets it there."""
    stats, verifier = overlap_run(llama_pair, ScriptedBaseline(contention=0.0))
    assert verifier.runs and stats[0].tree_run and not stats[0].ahead  # the first round started a run
    assert any(s.ahead for s in stats)


@dataclass
class ScriptedBaseline(AheadPolicy):
    """A learning policy whose baseline round is not asked to verify alone (so the first round starts a run)."""

    @property
    def needs_baseline(self) -> bool:
        return False
