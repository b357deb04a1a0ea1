"""EAGLE-2 tree builder: the reference's worked example by hand, and consistency with per-path runs."""

import pytest
import torch

from services.errors import InvalidRequest
from services.model.eagle_head import HeadConfig, build_head
from services.spec.tree import Candidates, TreeParams, expand, extend, grow_tree, rerank


def worked_example_candidates() -> Candidates:
    """K=2, D=2. Level 1: 18 (-0.1), 0 (-0.5). Step 0 expands both: children of 18 are 24 (-0.3),
    16 (-0.4); of 0: 24 (-0.6), 7 (-2.0). The best two (24, 16 under 18) are expanded at step 1
    with parents 1 + flat index = 3, 4; their children score -1.0 .. -1.3."""
    return Candidates(
        scores=torch.tensor([-0.1, -0.5, -0.3, -0.4, -0.6, -2.0, -1.0, -1.1, -1.2, -1.3]),
        tokens=torch.tensor([18, 0, 24, 16, 24, 7, 5, 6, 7, 8]),
        parents=torch.tensor([0, 1, 2, 3, 4]),
    )


def test_rerank_reproduces_reference_worked_example():
    tree = rerank(worked_example_candidates(), root=16, params=TreeParams(2, 2, 6), sort_paths=False)
    assert tree.tokens.tolist() == [16, 18, 0, 24, 16, 24]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    rows = ["".join(str(int(x)) for x in r) for r in tree.mask]
    assert rows == ["100000", "110000", "101000", "110100", "110010", "101001"]
    assert tree.scores.tolist() == pytest.approx([0.0, -0.1, -0.5, -0.3, -0.4, -0.6])


def test_depth_counts_expansion_steps_and_max_depth_the_deepest_node():
    """TreeParams.depth is expansion steps, not a node depth: keeping every candidate of the worked
    example (depth 2) gives a tree whose deepest node (max_depth, RoundStats.tree_max_depth) is at 3."""
    params = TreeParams(2, 2, 11)
    tree = rerank(worked_example_candidates(), root=16, params=params, sort_paths=False)
    assert tree.size == params.size and tree.max_depth == params.depth + 1
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


def test_sampling_sorts_paths_lexicographically_with_pads_last():
    cand = worked_example_candidates()
    greedy = rerank(cand, 16, TreeParams(2, 2, 5), sort_paths=False)
    # kept: 18, 0, 24, 16 -> node 2 (token 0) is a leaf and comes first in leaf order
    assert greedy.paths.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    sampled = rerank(cand, 16, TreeParams(2, 2, 5), sort_paths=True)
    assert sampled.paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, -1]]


def random_head(kind="eagle", vocab=50, hidden=32, seed=0):
    torch.manual_seed(seed)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    head = build_head(HeadConfig(kind, hidden, 64, 4, 2, 1e-6, vocab), lm_head).eval()
    for p in head.parameters():
        p.data.normal_(0, 0.3)
    return head.requires_grad_(False)


@pytest.mark.parametrize("params", [TreeParams(3, 3, 20), TreeParams(4, 2, 12), TreeParams(1, 4, 5)])
def test_tree_scores_equal_a_plain_run_along_each_path(params):
    """Each kept node's score is the sum of draft log-probs along its root-to-node path computed by
    running the head one token at a time on that path alone: the level masks and positions are right."""
    head = random_head()
    feats, toks = torch.randn(6, 32), torch.randint(0, 50, (6,))
    cache = head.new_cache(100)
    tree = grow_tree(head, cache, feats, toks, params, sort_paths=False)
    assert cache.length == 6, "tree rows must not stay in the draft KV"
    assert tree.size == params.size and tree.tokens[0] == toks[-1]
    for node in range(1, tree.size):
        path, n = [], node
        while n > 0:
            path.append(n)
            n = int(tree.parents[n])
        path.reverse()
        c = head.new_cache(100)
        x = extend(head, c, feats, toks)
        score = 0.0
        for depth, nd in enumerate(path):
            score += float(head.log_probs(x[None])[0, tree.tokens[nd]].detach())
            x = head(x[None], tree.tokens[nd:nd + 1], c, torch.tensor([6 + depth]))[0]
        assert score == pytest.approx(float(tree.scores[node]), abs=1e-4), node
        assert int(tree.depths[node]) == len(path)
    # the mask is ancestor-or-self
    for i in range(tree.size):
        anc, n = {i}, i
        while n > 0:
            n = int(tree.parents[n])
            anc.add(n)
        assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == anc


def test_extend_then_expand_equals_one_shot_extension():
    """Committing rows over several rounds gives the same draft state as one long extension."""
    head = random_head(seed=3)
    feats, toks = torch.randn(9, 32), torch.randint(0, 50, (9,))
    a = head.new_cache(100)
    extend(head, a, feats[:5], toks[:5])
    expand(head, a, extend(head, a, feats[5:], toks[5:]), TreeParams(3, 2, 10))  # leaves a at 9 rows
    b = head.new_cache(100)
    last_b = extend(head, b, feats, toks)
    assert a.length == b.length == 9
    assert torch.allclose(a.k[:, :, :9], b.k[:, :, :9], atol=1e-6)
    params = TreeParams(3, 2, 10)
    ta = rerank(expand(head, a, last_b, params), 7, params, False)
    tb = rerank(expand(head, b, last_b, params), 7, params, False)
    assert torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.paths, tb.paths)


@pytest.mark.parametrize("k,d,n,word", [(0, 5, 60, r"top_k must be >= 1 \(--tree-top-k\); got 0"),
                                         (10, -1, 60, r"depth must be >= 0 \(expansion steps, --tree-depth\); got -1"),
                                         (10, 5, 1, r"size must be >= 2 \(root \+ one draft; --tree-tokens\); got 1"),
                                         (2, 2, 12, r"size=12 needs more than the 10 candidates \(top_k \+ depth \* top_k\^2\) that top_k=2, depth=2")])
def test_impossible_tree_parameters(k, d, n, word):
    with pytest.raises(InvalidRequest, match=word):
        TreeParams(k, d, n)
    # the largest legal size is fine
    TreeParams(2, 2, 11)


def test_exact_ties_keep_the_tree_ancestor_closed():
    """A chain whose deeper log-probs are exactly 0 ties every descendant with its ancestor; the
    reference's topk may then keep a child without its parent. aerie keeps parents first."""
    cand = Candidates(scores=torch.tensor([-1.5, -1.6, -1.6, -1.6, -1.6]),
                      tokens=torch.tensor([5, 32, 38, 3, 4]), parents=torch.tensor([0, 1, 2, 3, 4]))
    tree = rerank(cand, 7, TreeParams(1, 4, 5), sort_paths=False)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert tree.paths.tolist() == [[0, 1, 2, 3, 4]]
    assert tree.tokens.tolist() == [7, 5, 32, 38, 3]
