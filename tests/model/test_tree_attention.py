"""Tree verification in one forward: every node's logits equal those of a plain causal forward over
the prompt plus that node's root-to-node path. The tree (mask, depths) is the one production builds
(`services.spec.tree.rerank` from draft candidates); the expected paths are written out by hand."""

from __future__ import annotations

import torch

from services.spec.tree import Candidates, TreeParams, rerank

PROMPT_LEN = 11
# Draft candidates for K=2, D=2 (flat indices 0-1: the root's children; 2-5: children of flat 0 and 1;
# 6-9: children of flat 2 and 4). The 6 best scores are flat 0, 2, 6, 1, 4, 8.
CANDIDATES = Candidates(
    scores=torch.tensor([-0.1, -0.5, -0.2, -0.9, -0.6, -2.0, -0.3, -3.0, -0.7, -4.0]),
    tokens=torch.arange(10, 20),
    parents=torch.tensor([0, 1, 2, 3, 5]),  # per K-block: 1 + flat index of the parent, 0 = root
)
PARAMS = TreeParams(top_k=2, depth=2, size=7)
# by hand: nodes 1..6 = flat 0, 1, 2, 4, 6, 8 (ascending flat order, parents first)
PATHS = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5], [0, 2, 4, 6]]
PARENTS = [-1, 0, 0, 1, 2, 3, 4]


def tree_inputs(tiny, seed: int = 7):
    """(prompt ids, the production tree with random token ids, tree positions)."""
    tree = rerank(CANDIDATES, root=3, params=PARAMS, sort_paths=False)
    prompt = tiny.random_ids(PROMPT_LEN, seed=seed)
    tokens = tiny.random_ids(len(PARENTS), seed=seed + 1)
    return prompt, tokens, tree.mask, PROMPT_LEN + tree.depths


def test_production_tree_is_the_hand_built_one() -> None:
    tree = rerank(CANDIDATES, root=3, params=PARAMS, sort_paths=False)
    assert tree.parents.tolist() == PARENTS
    assert tree.depths.tolist() == [len(p) - 1 for p in PATHS]
    assert tree.tokens.tolist() == [3, 10, 11, 12, 14, 16, 18]
    for node, path in enumerate(PATHS):
        assert tree.mask[node].nonzero().flatten().tolist() == path, node


def test_tree_forward_matches_causal_forward_of_each_path(tiny, tiny_llama) -> None:
    model = tiny_llama[0].model
    prompt, tokens, mask, positions = tree_inputs(tiny)

    cache = model.new_cache(PROMPT_LEN + len(PARENTS))
    model(prompt, cache)
    tree = model(tokens, cache, positions=positions, tree_mask=mask)
    assert cache.length == PROMPT_LEN + len(PARENTS)
    assert tree.logits.shape == (len(PARENTS), model.config.vocab_size)

    for node, path in enumerate(PATHS):
        ids = torch.cat([prompt, tokens[path]])
        ref = tiny.native_forward(model, ids)
        torch.testing.assert_close(tree.logits[node], ref.logits[-1], atol=tiny.ATOL, rtol=0,
                                   msg=f"node {node} path {path}")
        torch.testing.assert_close(tree.hidden[node], ref.hidden[-1], atol=tiny.ATOL, rtol=0)


def test_tree_forward_matches_transformers_on_a_leaf_path(tiny, tiny_llama) -> None:
    """The same check against transformers itself, for the deepest nodes."""
    loaded, hf = tiny_llama
    prompt, tokens, mask, positions = tree_inputs(tiny)
    cache = loaded.model.new_cache(PROMPT_LEN + len(PARENTS))
    loaded.model(prompt, cache)
    tree = loaded.model(tokens, cache, positions=positions, tree_mask=mask)
    for node in (5, 6):
        path = PATHS[node]
        ref_logits, _ = tiny.hf_forward(hf, torch.cat([prompt, tokens[path]]))
        torch.testing.assert_close(tree.logits[node], ref_logits[-1], atol=tiny.ATOL, rtol=0)


def test_tree_mask_and_positions_matter(tiny, tiny_llama) -> None:
    """Guard: a causal forward of the same 7 tokens gives different logits, so the test above
    really exercises the mask and the depth positions."""
    model = tiny_llama[0].model
    prompt, tokens, mask, positions = tree_inputs(tiny)
    cache = model.new_cache(PROMPT_LEN + len(PARENTS))
    model(prompt, cache)
    causal = model(tokens, cache).logits
    cache.truncate(PROMPT_LEN)
    tree = model(tokens, cache, positions=positions, tree_mask=mask).logits
    for node, path in enumerate(PATHS):
        if path == list(range(node + 1)):  # root 0 and node 1 see the same rows either way
            torch.testing.assert_close(tree[node], causal[node], atol=tiny.ATOL, rtol=0)
        else:
            assert not torch.allclose(tree[node], causal[node], atol=1e-3), node
