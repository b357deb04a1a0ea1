"""Retrieval drafts: the suffix index against brute force, merging a chain into a tree (a valid
DraftTree that the wire codec accepts), and exact sampling with a merged chain (chi-square)."""

import random

import pytest
import torch

from services.rpc import codec
from services.spec.sam import SuffixIndex
from services.spec.sampling import SamplingParams, round_generator, sample, target_probs
from services.spec.tree import build_tree, merge_chain, root_tree
from services.spec.verify import accept_greedy, accept_sampling
from tests.spec.test_sampling import chi_square_p, mock_logits, node_prefix, ranked
import tests.spec.test_sampling as ts


def brute(text: list[int], limit: int, min_match: int) -> list[int]:
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length:]
        for start in range(0, n - length):
            if text[start:start + length] == suffix:
                if length < min_match:
                    return []
                return text[start + length: start + length + limit]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_propose_equals_brute_force_incrementally(seed):
    rnd = random.Random(seed)
    alphabet = rnd.choice([2, 3, 5])
    idx = SuffixIndex(min_match=2)
    text = []
    for _ in range(60):
        chunk = [rnd.randrange(alphabet) for _ in range(rnd.randint(1, 4))]
        idx.extend(chunk)
        text += chunk
        assert idx.propose(6) == brute(text, 6, 2), text


def test_propose_examples():
    idx = SuffixIndex()
    idx.extend([1, 2, 3, 9, 1, 2])
    assert idx.match() == (2, 1) and idx.propose(3) == [3, 9, 1]
    idx.extend([7])
    assert idx.propose(3) == []  # [7] never occurred before
    one = SuffixIndex(min_match=3)
    one.extend([1, 2, 3, 9, 1, 2])
    assert one.propose(3) == []  # a 2-token match is below min_match


def tree_a():
    # root 7 -> 5 (-0.1), 9 (-0.5); 5 -> 3 (-0.4)
    return build_tree(torch.tensor([7, 5, 9, 3]), torch.tensor([-1, 0, 0, 1]),
                      torch.tensor([0.0, -0.1, -0.5, -0.4]), False)


def test_merge_chain_shares_the_prefix_and_stays_a_valid_tree():
    merged, nodes = merge_chain(tree_a(), [5, 4, 8], False)
    assert merged.tokens.tolist() == [7, 5, 9, 3, 4, 8]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    assert nodes == [1, 4, 5]
    assert merged.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert merged.scores.tolist()[4:] == [0.0, 0.0]
    # the wire codec rebuilds and checks mask, depths and paths
    back = codec.decode_tree(codec.encode_tree(merged), 100)
    assert torch.equal(back.mask, merged.mask) and torch.equal(back.depths, merged.depths)
    assert sorted(map(tuple, merged.paths.tolist())) == [(0, 1, 3, -1), (0, 1, 4, 5), (0, 2, -1, -1)]
    same, nodes = merge_chain(tree_a(), [5, 3], False)
    assert same.size == 4 and nodes == [1, 3]
    alone, nodes = merge_chain(root_tree(7), [1, 2], True)
    assert alone.tokens.tolist() == [7, 1, 2] and alone.paths.tolist() == [[0, 1, 2]] and nodes == [1, 2]


def test_greedy_accepts_along_the_chain():
    merged, _ = merge_chain(tree_a(), [9, 4, 8], False)  # 9 is shared, 4 and 8 are new
    logits = torch.full((merged.size, 20), -5.0)
    want = {0: 9, 2: 4, 4: 8, 5: 11}  # the target's argmax at root, 9, 4, 8
    for node, tok in want.items():
        logits[node, tok] = 5.0
    acc = accept_greedy(merged, logits)
    assert acc.nodes.tolist() == [0, 2, 4, 5] and acc.new_tokens == [9, 4, 8, 11]


def merged_tree():
    """test_sampling's tree with a retrieved chain [b, b0, b00] merged: b is shared, b0 (the target's
    top token after b, not in the tree) and b00 are new nodes."""
    b = ranked((0,), 1)
    b0 = ranked((0, b), 0)
    b00 = ranked((0, b, b0), 0)
    tree = ts.build_tree()
    merged, nodes = merge_chain(tree, [b, b0, b00], True)
    assert merged.size == tree.size + 2 and nodes[0] == 2
    return merged


MERGED = merged_tree()


def first_three_merged(params, draw, wrong, wrong_context=False):
    assert not wrong_context and params.repetition_penalty == 1.0  # (mock_logits: no penalty here)
    gen = round_generator(params.seed, draw)
    logits = torch.stack([mock_logits(node_prefix(MERGED, i)) for i in range(MERGED.size)])
    acc = accept_sampling(MERGED, logits, params, gen)
    if wrong and bool((MERGED.parents == int(acc.nodes[-1])).any()):
        out = acc.tokens[1:].tolist() + [sample(target_probs(logits[int(acc.nodes[-1])], params), gen)]
    else:
        out = acc.new_tokens
    prefix = node_prefix(MERGED, 0) + tuple(out)
    while len(out) < 3:
        tok = sample(target_probs(mock_logits(prefix), params), gen)
        out.append(tok)
        prefix += (tok,)
    return tuple(out[:3])


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_sampling_with_a_merged_chain_keeps_the_target_distribution(monkeypatch):
    monkeypatch.setattr(ts, "first_three", first_three_merged)
    params = SamplingParams(1.0, seed=7)
    assert chi_square_p(params, wrong=False) > 1e-3
    assert chi_square_p(params, wrong=True) < 1e-6, "the check must fail a wrong rule"
