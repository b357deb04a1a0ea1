"""Sampling verification is lossless: a chi-square test over the first three emitted tokens that the
real rule passes and a deliberately wrong rule (bonus drawn from the un-residualised distribution)
fails; plus seeded determinism and the logits processor. With min-p and a repetition penalty the
target distribution is the processed one; the penalty's context is per tree node (its root-to-node
path), and penalising every node with the committed context alone (a wrong context) fails."""

import itertools
import math

import pytest
import torch
from scipy import stats

from services.errors import InvalidRequest
from services.spec.penalty import SeenTokens
from services.spec.sampling import SamplingParams, process_logits, round_generator, sample, target_probs
from services.spec.tree import DraftTree
from services.spec.verify import accept_sampling

V = 5


def make_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    n = len(tokens)
    depths, mask = [0] * n, torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    width = max(depths) + 1
    rows = []
    for leaf in (i for i in range(n) if i not in parents):
        row, node = [-1] * width, leaf
        for d in range(depths[leaf], -1, -1):
            row[d], node = node, parents[node]
        rows.append(row)
    rows.sort(key=lambda r: [x if x >= 0 else n + 5 for x in r])
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), mask,
                     torch.tensor(rows), torch.zeros(n))


def mock_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed 'target': next-token logits [V] as a deterministic function of the prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(V, generator=g) * 1.5


def ranked(prefix: tuple[int, ...], r: int) -> int:
    """The r-th most likely next token of the mock target: a drafter that is often right."""
    return int(torch.argsort(mock_logits(prefix), descending=True)[r])


def build_tree() -> DraftTree:
    """root 0 -> {a -> {c -> {e}, d}, b -> {f}} with a, b the target's two most likely tokens,
    c, d the two most likely after a, etc.: paths [0,1,3,6], [0,1,4,-1], [0,2,5,-1]."""
    a, b = ranked((0,), 0), ranked((0,), 1)
    c, d = ranked((0, a), 0), ranked((0, a), 1)
    f = ranked((0, b), 1)
    e = ranked((0, a, c), 0)
    return make_tree([0, a, b, c, d, f, e], [-1, 0, 0, 1, 1, 2, 3])


TREE = build_tree()


def node_prefix(tree: DraftTree, node: int) -> tuple[int, ...]:
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tuple(reversed(out))


def target_logits(prefix: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The mock target's logits after `prefix`, penalised independently of services/spec/penalty.py:
    transformers' RepetitionPenaltyLogitsProcessor over the whole prefix."""
    from transformers import RepetitionPenaltyLogitsProcessor

    x = mock_logits(prefix)
    if params.repetition_penalty == 1.0:
        return x
    return RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([prefix]), x[None])[0]


def tree_logits(params: SamplingParams, wrong_context: bool = False) -> torch.Tensor:
    """[N, V]: what the verifier hands acceptance: the raw logits of every tree node, penalised with
    the node's own context (SeenTokens.penalize), or (wrong_context) with the root's alone."""
    raw = torch.stack([mock_logits(node_prefix(TREE, i)) for i in range(TREE.size)])
    seen = SeenTokens(V, "cpu")
    ancestors = TREE.mask
    if wrong_context:  # every node sees the root only
        ancestors = torch.zeros_like(TREE.mask)
        ancestors[:, 0] = True
    return seen.penalize(raw, params.repetition_penalty, TREE.tokens, ancestors)


def first_three(params: SamplingParams, draw: int, wrong: bool, wrong_context: bool = False) -> tuple[int, ...]:
    gen = round_generator(params.seed, draw)
    logits = tree_logits(params, wrong_context)
    acc = accept_sampling(TREE, logits, params, gen)
    if wrong and bool((TREE.parents == int(acc.nodes[-1])).any()):
        # every child of the last accepted node was rejected: a wrong rule ignores the residual
        acc_bonus = sample(target_probs(logits[int(acc.nodes[-1])], params), gen)
        out = acc.tokens[1:].tolist() + [acc_bonus]
    else:
        out = acc.new_tokens
    prefix = node_prefix(TREE, 0) + tuple(out)
    while len(out) < 3:  # continue with plain target sampling
        tok = sample(target_probs(target_logits(prefix, params), params), gen)
        out.append(tok)
        prefix += (tok,)
    return tuple(out[:3])


def exact_joint(params: SamplingParams) -> dict[tuple[int, ...], float]:
    joint = {}
    for y in itertools.product(range(V), repeat=3):
        p, prefix = 1.0, (0,)
        for tok in y:
            p *= float(target_probs(target_logits(prefix, params), params)[tok])
            prefix += (tok,)
        joint[y] = p
    return joint


def chi_square_p(params: SamplingParams, wrong: bool, n: int = 12000, wrong_context: bool = False) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for i in range(n):
        y = first_three(params, i, wrong, wrong_context)
        counts[y] = counts.get(y, 0) + 1
    joint = exact_joint(params)
    obs, exp, rest_obs, rest_exp = [], [], 0, 0.0
    for y, p in joint.items():
        if p * n >= 5:
            obs.append(counts.get(y, 0))
            exp.append(p * n)
        else:
            rest_obs += counts.get(y, 0)
            rest_exp += p * n
    assert sum(counts.get(y, 0) for y, p in joint.items() if p == 0) == 0, "emitted a filtered token"
    if rest_exp > 0:  # (min-p can filter every rare outcome: then there is no rest bucket)
        obs.append(rest_obs)
        exp.append(rest_exp)
    exp = [e * sum(obs) / sum(exp) for e in exp]  # guard float drift in the totals
    return float(stats.chisquare(obs, exp).pvalue)


SETTINGS = [SamplingParams(1.0, seed=1), SamplingParams(0.8, top_p=0.95, seed=2),
            SamplingParams(1.0, top_k=3, seed=3), SamplingParams(1.0, min_p=0.2, seed=4),
            SamplingParams(1.0, repetition_penalty=1.8, seed=5),
            SamplingParams(0.9, top_k=4, min_p=0.1, repetition_penalty=1.5, seed=6)]
IDS = ["T=1", "T=0.8,top_p=0.95", "T=1,top_k=3", "T=1,min_p=0.2", "T=1,rep=1.8", "T=0.9,top_k=4,min_p=0.1,rep=1.5"]


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
@pytest.mark.parametrize("params", SETTINGS, ids=IDS)
def test_rejection_sampling_preserves_the_target_distribution(params):
    assert chi_square_p(params, wrong=False) > 1e-3


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_the_test_detects_a_wrong_rule():
    assert chi_square_p(SETTINGS[0], wrong=True) < 1e-6


def test_the_test_detects_a_penalty_with_the_wrong_context():
    """Penalising every tree node with the committed context only (not its own path) is not the
    target's distribution: the same harness rejects it."""
    assert chi_square_p(SETTINGS[4], wrong=False, wrong_context=True) < 1e-6


def test_rounds_replay_from_seed_and_round():
    params = SamplingParams(1.0, seed=7)
    a = [first_three(params, 3, False) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    draws = {first_three(params, i, False) for i in range(40)}
    assert len(draws) > 5  # different rounds draw differently


def test_processor_matches_transformers_warpers():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(0.7, top_p=0.8, top_k=10)
    ref = TopKLogitsWarper(10)(None, TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, logits)))
    ours = process_logits(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_min_p_and_penalty_match_transformers():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(0.7, min_p=0.15)
    ref = MinPLogitsWarper(0.15)(None, logits / 0.7)
    ours = process_logits(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)) and torch.isinf(ours).any()
    assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])
    context = torch.tensor([[3, 7, 7, 40]] * 3)
    seen = SeenTokens(50, "cpu")
    seen.add(context[0])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(context, logits.clone())
    assert torch.allclose(seen.penalize(logits, 1.3), ref)


def test_each_tree_node_is_penalised_with_its_own_path():
    """tokens [7, 3, 9, 3, 7], parents [-1, 0, 0, 1, 3], context {1, 9}: node i's row equals
    transformers' processor over (context, path to i), repeated tokens penalised once."""
    from transformers import RepetitionPenaltyLogitsProcessor

    tree = make_tree([7, 3, 9, 3, 7], [-1, 0, 0, 1, 3])
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
    seen = SeenTokens(12, "cpu")
    seen.add([1, 9, 1])
    got = seen.penalize(logits, 1.5, tree.tokens, tree.mask)
    for i in range(5):
        context = [1, 9] + [int(tree.tokens[j]) for j in range(5) if tree.mask[i, j]]
        ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([context]), logits[i:i + 1].clone())[0]
        assert torch.allclose(got[i], ref), i
    assert torch.equal(logits, torch.randn(5, 12, generator=torch.Generator().manual_seed(2)))  # not modified


@pytest.mark.parametrize("kw,word", [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                      ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                      ({"temperature": math.nan}, "temperature"), ({"seed": -1}, "seed"),
                                      ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
                                      ({"logprobs": 21}, "logprobs")])
def test_bad_sampling_parameters(kw, word):
    with pytest.raises(InvalidRequest, match=word):
        SamplingParams(**kw)


def accept_new_tokens(tree: DraftTree, params: SamplingParams, draw: int) -> list[int]:
    logits = torch.stack([mock_logits(node_prefix(tree, i)) for i in range(tree.size)])
    return accept_sampling(tree, logits, params, round_generator(params.seed, draw)).new_tokens


def test_duplicate_siblings_are_tried_once():
    """Sibling de-duplication: a token already rejected at this level is skipped without a draw, so a
    tree with a duplicated sibling accepts exactly what the tree without it accepts, draw for draw
    (re-testing it would consume a uniform draw and shift every later decision)."""
    a, b = ranked((0,), 0), ranked((0,), 1)
    c = ranked((0, a), 0)
    with_dup = make_tree([0, a, a, b, c], [-1, 0, 0, 0, 1])
    without = make_tree([0, a, b, c], [-1, 0, 0, 1])
    params = SamplingParams(1.0, seed=5)
    results = [(accept_new_tokens(with_dup, params, i), accept_new_tokens(without, params, i)) for i in range(300)]
    assert all(x == y for x, y in results)
    assert sum(x[0] != a for x, _ in results) > 20  # `a` was often rejected: then the duplicate is met
