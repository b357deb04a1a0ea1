"""The one fail-over case whose sampled output is not the undisturbed run's: rounds decoded without a
drafter (none answering). Such a round verifies a root-only tree, so its token is drawn from the
target's processed distribution at the root with the round's (seed, round) generator: a different
draw from the speculative round it replaces, but from exactly the target's distribution. A
chi-square test checks that, and fails a deliberately wrong rule (temperature and top-p ignored)."""

import torch
from scipy import stats

from services.spec.sampling import SamplingParams, round_generator, sample, target_probs
from services.spec.tree import root_tree
from services.spec.verify import accept_sampling

V = 6
N = 4000


def counts(draw) -> list[int]:
    c = [0] * V
    for seed in range(N):
        c[draw(round_generator(seed, 7))] += 1
    return c


def pvalue(observed: list[int], probs: torch.Tensor) -> float:
    keep = [i for i in range(V) if probs[i] > 0]
    if any(observed[i] for i in range(V) if i not in keep):
        return 0.0  # a token the target can never produce
    exp = [float(probs[i]) * N for i in keep]
    obs = [observed[i] for i in keep]
    scale = sum(obs) / sum(exp)
    return float(stats.chisquare(obs, [e * scale for e in exp]).pvalue)


def test_a_plain_round_draws_from_the_target_distribution():
    logits = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -2.0])
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=0)
    probs = target_probs(logits, params)
    tree = root_tree(3)
    real = counts(lambda g: accept_sampling(tree, logits[None], params, g).bonus)
    assert pvalue(real, probs) > 1e-3
    # the accepted path is the root alone: the round commits exactly one token
    assert accept_sampling(tree, logits[None], params, round_generator(0, 7)).accepted == 0
    wrong = counts(lambda g: sample(torch.softmax(logits, -1), g))  # temperature / top-p ignored
    assert pvalue(wrong, probs) < 1e-6
