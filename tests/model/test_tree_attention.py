"""Tree verification in one forward: every node's logits equal those of a plain causal forward over
the prompt plus that node's root-to-node path."""

from __future__ import annotations

import torch

# root 0; children 1, 2; grandchildren 3, 4 (of 1) and 5, 6 (of 2)
PARENTS = [-1, 0, 0, 1, 1, 2, 2]
PROMPT_LEN = 11


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-node index path of every node."""
    paths = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths.append(path)
    return paths


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: row i may attend to column j iff j is i or an ancestor of i."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, path in enumerate(tree_paths(parents)):
        mask[node, path] = True
    return mask


def tree_inputs(tiny, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, tree token ids, tree mask, tree positions)."""
    prompt = tiny.random_ids(PROMPT_LEN, seed=seed)
    tokens = tiny.random_ids(len(PARENTS), seed=seed + 1)
    depth = torch.tensor([len(p) - 1 for p in tree_paths(PARENTS)])
    return prompt, tokens, tree_mask(PARENTS), PROMPT_LEN + depth


def test_tree_mask_shape_is_ancestors_or_self() -> None:
    mask = tree_mask(PARENTS)
    assert mask.diagonal().all()
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert mask[1].nonzero().flatten().tolist() == [0, 1]
    assert not mask.triu(1).any()  # BFS order: ancestors come first


def test_tree_forward_matches_causal_forward_of_each_path(tiny, tiny_llama) -> None:
    model = tiny_llama[0].model
    prompt, tokens, mask, positions = tree_inputs(tiny)

    cache = model.new_cache(PROMPT_LEN + len(PARENTS))
    model(prompt, cache)
    tree = model(tokens, cache, positions=positions, tree_mask=mask)
    assert cache.length == PROMPT_LEN + len(PARENTS)
    assert tree.logits.shape == (len(PARENTS), model.config.vocab_size)

    for node, path in enumerate(tree_paths(PARENTS)):
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
    for node in (3, 6):
        path = tree_paths(PARENTS)[node]
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
    for node, path in enumerate(tree_paths(PARENTS)):
        if path == list(range(node + 1)):  # root 0 and node 1 see the same rows either way
            torch.testing.assert_close(tree[node], causal[node], atol=tiny.ATOL, rtol=0)
        else:
            assert not torch.allclose(tree[node], causal[node], atol=1e-3), node
