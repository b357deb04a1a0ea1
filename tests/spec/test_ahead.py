"""services/spec/ahead.py (guess, follow, reroot, use_ahead) and services/spec/overlap.py (the
policy, with a synthetic cost model: no timing), and exact sampling on a rerooted ahead tree (chi-square
with a wrong-rule control)."""

import pytest
import torch

import tests.spec.test_sampling as ts
from services.spec.ahead import follow, prefix_hits, reroot, top_guess, trim, use_ahead
from services.spec.overlap import AheadPolicy
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams, build_tree


def tree(tokens, parents, scores=None, sort_paths=False):
    scores = torch.tensor(scores if scores is not None else [0.0] * len(tokens))
    return build_tree(torch.tensor(tokens), torch.tensor(parents), scores, sort_paths)


T = tree([7, 5, 8, 3, 4], [-1, 0, 0, 1, 1], [0, -0.1, -2, -0.3, -0.9])


def test_top_guess_follow_reroot():
    assert top_guess(T, 1) == [5] and top_guess(T, 5) == [5, 3]
    assert follow(T, [5, 3]) == 3 and follow(T, []) == 0 and follow(T, [8, 1]) is None
    sub = reroot(T, 1, False)
    assert sub.tokens.tolist() == [5, 3, 4] and sub.parents.tolist() == [-1, 0, 0]
    assert sub.scores.tolist() == pytest.approx([0.0, -0.2, -0.8])
    assert sub.paths.tolist() == [[0, 1], [0, 2]]


def test_use_ahead_hit_and_miss():
    ahead = tree([5, 3, 9, 2, 6], [-1, 0, 1, 0, 2])  # rooted at the guess's last token 5
    assert use_ahead(ahead, [5], [5, 3, 9], False).tokens.tolist() == [9, 6]  # rerooted at the bonus
    assert use_ahead(ahead, [5], [5], False).size == 5  # the bonus was the guess's last token
    assert use_ahead(ahead, [5], [8, 3], False) is None  # prefix contradicted
    assert use_ahead(ahead, [5], [5, 4], False) is None  # bonus not in the ahead tree
    assert use_ahead(ahead, [5], [5, 2], False) is None  # a leaf: the root alone drafts nothing
    assert prefix_hits([5, 3, 2], [5, 3, 9]) == [False, True, False]
    assert prefix_hits([5, 3, 2], [5, 3, 2, 1]) == [False, False, True]


def test_policy_turns_overlap_off_when_it_cannot_pay():
    """Synthetic cost model: draft 10 ms, head step 1 ms."""
    p = AheadPolicy(contention=0.0, learn_cost=False)
    assert p.choose(0.010, 0.001, path_len=3) == 1  # free overlap and the prior: draft ahead
    assert AheadPolicy(contention=1.0, learn_cost=False).choose(0.010, 0.001, 3) is None  # never pays
    assert p.choose(0.010, 0.001, 3, busy=1.0) is None  # a saturated drafter pool: not at all
    assert p.choose(0.010, 0.001, path_len=0) is None  # nothing to guess from
    q = AheadPolicy(contention=0.3, learn_cost=False)
    for _ in range(60):  # guesses never hit: learned, and overlap turns off
        q.observe_verdict([False, False, False])
    assert q.choose(0.010, 0.001, 3) is None
    for _ in range(60):  # they start to hit (learned from every round, drafted ahead or not): back on
        q.observe_verdict([True, True, False])
        q.observe_ahead(True)
    assert q.choose(0.010, 0.001, 3) in (1, 2)


def test_a_learning_policy_drafts_ahead_alone_on_a_drafter_not_beside_other_sequences():
    """Synthetic cost model (draft 10 ms, head step 1 ms, guesses that always hit, no contention
    measured): alone on its drafter a learning policy drafts ahead; with 4 of its coordinator's
    sequences there (their ahead drafts run one at a time, not batched) it does not, nor does it
    explore the other choice. A fixed policy (`--overlap always`) ignores the count."""
    p = AheadPolicy(contention=0.0)
    p.observe_alone(0.020)  # (its verify baseline)
    for _ in range(30):
        p.observe_verdict([True, True, True])
        p.observe_ahead(True)
    kw = dict(measured=True, chained=True)  # (as the engine asks: the ahead tree holds the chain)
    assert p.choose(0.010, 0.001, 3, **kw) == 1
    assert all(p.choose(0.010, 0.001, 3, sharing=4, **kw) is None for _ in range(40))
    assert p.choose(0.010, 0.001, 3, sharing=1, **kw) == 1
    assert AheadPolicy(contention=0.0, learn_cost=False).choose(0.010, 0.001, 3, sharing=16, chained=True) == 1


def test_policy_learns_contention_from_seconds():
    p = AheadPolicy(contention=0.0)
    p.observe_alone(0.020)
    for _ in range(30):  # every ahead draft (10 ms) is fully on the critical path
        p.observe_cost(ahead_s=0.010, wait_s=0.0, verify_s=0.030)
    assert p.contention > 0.9
    assert p.choose(0.010, 0.001, 3) is None


def _simulate(p: AheadPolicy, verify_alone: float, verify_ahead: float, rounds: int = 96) -> list[bool]:
    """Synthetic rounds (no timing): a 5 ms draft whose guesses hit; a round with an ahead draft
    (10 ms, waited for 0.3 ms) verifies in `verify_ahead` s, one without in `verify_alone` s.
    -> per round, whether the policy drafted ahead."""
    out = []
    for _ in range(rounds):
        j = p.choose(0.005, 0.0005, 3, chained=True, measured=True)
        p.observe_verdict([True, True, False])
        if j is None:
            p.observe_alone(verify_alone)
        else:
            p.observe_ahead(True)
            p.observe_cost(ahead_s=0.010, wait_s=0.0003, verify_s=verify_ahead)
        out.append(j is not None)
    return out


def test_policy_measures_the_verify_alone_and_turns_off_when_ahead_drafts_slow_it():
    """In process the ahead draft hardly waits (0.3 ms) but doubles the verify (10 -> 20 ms: the
    threads share the interpreter lock). A policy that drafted ahead from the first round never saw
    the verify alone and kept drafting ahead (0.71x measured); it now runs its first tree round
    alone and explores, so it learns the slowdown and stops. Where the verify is not slowed it keeps
    drafting ahead but for the exploring rounds."""
    slowed = _simulate(AheadPolicy(), verify_alone=0.010, verify_ahead=0.020)
    assert not slowed[0]  # the baseline round
    assert sum(slowed[32:]) <= 64 // 16 + 1  # afterwards only the exploring rounds draft ahead
    free = _simulate(AheadPolicy(), verify_alone=0.010, verify_ahead=0.010)
    assert not free[0] and sum(free[32:]) >= 64 - 64 // 16 - 1  # every round but the exploring ones
    # sampling sequences (measured=False) neither wait for a baseline nor explore: a seed replays
    assert AheadPolicy(contention=0.0).choose(0.005, 0.0005, 3, chained=True) is not None

def _ahead_tree_around_ts():
    """An ahead tree rooted at guessed token 3 whose child 0 carries test_sampling's tree, plus a
    sibling: rerooting at 0 must give that tree exactly."""
    t = ts.TREE
    toks = [3] + t.tokens.tolist() + [1]
    parents = [-1] + [p + 1 if p >= 0 else 0 for p in t.parents.tolist()] + [0]
    return tree(toks, parents, sort_paths=True)


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_sampling_on_a_rerooted_ahead_tree_keeps_the_target_distribution(monkeypatch):
    sub = use_ahead(_ahead_tree_around_ts(), [3], [3, 0], True)
    assert sub.tokens.tolist() == ts.TREE.tokens.tolist() and sub.paths.tolist() == ts.TREE.paths.tolist()
    monkeypatch.setattr(ts, "TREE", sub)
    params = SamplingParams(1.0, seed=7)
    assert ts.chi_square_p(params, wrong=False) > 1e-3
    assert ts.chi_square_p(params, wrong=True) < 1e-6, "the check must fail a wrong rule"


def test_trim_cuts_an_ahead_tree_back_to_the_rounds_shape():
    # 7 -> 5 -> 3 -> 2 and 7 -> 8: depth 1 (two levels) and size 3 keep the best ancestor-closed nodes
    t = tree([7, 5, 8, 3, 2], [-1, 0, 0, 1, 3], [0, -0.1, -2, -0.3, -0.4])
    cut = trim(t, TreeParams(top_k=2, depth=1, size=3), False)
    assert cut.tokens.tolist() == [7, 5, 3] and cut.parents.tolist() == [-1, 0, 1]
    assert trim(t, TreeParams(top_k=2, depth=3, size=5), False) is t  # it fits: unchanged
    tied = tree([7, 5, 3, 4], [-1, 0, 1, 1], [0, 0.0, 0.0, 0.0])  # exact ties: a parent is never cut off
    assert trim(tied, TreeParams(top_k=2, depth=2, size=2), False).tokens.tolist() == [7, 5]
    stop = trim(t, TreeParams(top_k=2, depth=3, size=5, stop_logprob=-0.35), False)
    assert stop.tokens.tolist() == [7, 5, 3]


def test_chained_policy_counts_every_accept_length_past_the_guess():
    """With the chain (services/spec/ahead_tree.py) a guess of 1 also hits when the verdict accepts
    more of the top path: the hit probability sums the prefix rates from j on (synthetic verdicts)."""
    p = AheadPolicy(contention=0.5, learn_cost=False)
    for _ in range(80):  # the verdict accepts the top path's first 3 tokens, then the bonus
        p.observe_verdict([False, False, True])
        p.observe_ahead(True)
    assert p.choose(0.010, 0.001, 3) == 3  # one tree at the guess's end: only a guess of 3 can hit
    assert p.choose(0.010, 0.001, 3, chained=True) == 1  # the chain: a guess of 1 hits too
    assert AheadPolicy(contention=1.0, learn_cost=False).choose(0.010, 0.001, 3, chained=True) is None
