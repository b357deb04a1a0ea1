"""Greedy verification golden cases: perfect match, early mismatch, sibling accepted, leaf bonus."""

import torch

from services.spec.tree import Candidates, TreeParams, rerank
from services.spec.verify import accept_greedy

V = 32


def tree():
    # root 16; children 18 (node 1), 0 (node 2); 24 (3), 16 (4) under 18; 24 (5) under 0
    cand = Candidates(torch.tensor([-0.1, -0.5, -0.3, -0.4, -0.6, -2.0, -1.0, -1.1, -1.2, -1.3]),
                      torch.tensor([18, 0, 24, 16, 24, 7, 5, 6, 7, 8]), torch.tensor([0, 1, 2, 3, 4]))
    return rerank(cand, 16, TreeParams(2, 2, 6), sort_paths=False)


def logits_with_argmax(per_node: list[int]) -> torch.Tensor:
    logits = torch.randn(len(per_node), V) * 0.1
    for i, tok in enumerate(per_node):
        logits[i, tok] = 5.0
    return logits


def test_perfect_match_accepts_the_whole_path():
    # target: after root -> 18, after 18 -> 16, after node 4 (16) -> 9
    acc = accept_greedy(tree(), logits_with_argmax([18, 16, 3, 3, 9, 3]))
    assert acc.accepted == 2 and acc.nodes.tolist() == [0, 1, 4]
    assert acc.tokens.tolist() == [16, 18, 16] and acc.bonus == 9
    assert acc.new_tokens == [18, 16, 9]


def test_early_mismatch_accepts_nothing_and_bonus_is_target_argmax():
    acc = accept_greedy(tree(), logits_with_argmax([30, 1, 1, 1, 1, 1]))
    assert acc.accepted == 0 and acc.nodes.tolist() == [0] and acc.bonus == 30
    assert acc.new_tokens == [30]


def test_second_sibling_accepted():
    # after root the target wants 0 (node 2), then 24 (node 5, a leaf): bonus from node 5's logits
    acc = accept_greedy(tree(), logits_with_argmax([0, 1, 24, 1, 1, 11]))
    assert acc.nodes.tolist() == [0, 2, 5] and acc.bonus == 11 and acc.accepted == 2


def test_partial_path_bonus_from_last_accepted_node():
    acc = accept_greedy(tree(), logits_with_argmax([18, 7, 1, 1, 1, 1]))
    assert acc.nodes.tolist() == [0, 1] and acc.bonus == 7
