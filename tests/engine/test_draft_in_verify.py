"""Drafting inside the Verify (Engine, "Drafting inside the Verify"): a verifier role that drafts too
gets each tree round's next shape with the Verify and returns the next tree with the verdict; the
engine uses it cut to the budget's next plan, or leaves it for a plain round. In process here (the
coordinator's placement makes the same calls over gRPC: tests/coordinator/test_colocated.py), with a
scripted budget whose plans change every round: greedy output equals transformers' token for token,
and each drafted tree is counted once as kept, trimmed or unused."""

from dataclasses import dataclass, field, replace

import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.acceptance import prior_stats
from services.spec.budget import Budget, RoundPlan
from services.spec.cost import CostCurve, CostModel
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, hf_greedy

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
    """Plans SCRIPT round after round (the prefill's plan included), whatever was accepted."""
    count: list = field(default_factory=lambda: [0])

    def plan(self, stats, chain=0, commit_rows=2.0, key=None, adapt=True, pending_rows=0) -> RoundPlan:
        tree = SCRIPT[self.count[0] % len(SCRIPT)]
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
