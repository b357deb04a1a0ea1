"""After tree verification, `KVCache.keep` compacts the accepted path; decoding then continues as if
only the prompt and the accepted tokens had ever been seen."""

from __future__ import annotations

import pytest
import torch

from services.errors import CapacityExceeded
from services.model.kv_cache import KVCache

PARENTS = [-1, 0, 0, 1, 1, 2, 2]  # root 0; 1, 2 under it; 3, 4 under 1; 5, 6 under 2
PROMPT_LEN = 9


def tree_mask_and_depth(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for node in range(n):
        a = node
        while a >= 0:
            mask[node, a] = True
            a = parents[a]
        depth[node] = int(mask[node].sum()) - 1
    return mask, depth


@pytest.mark.parametrize("accepted", [[0], [0, 1], [0, 2], [0, 2, 5], [0, 1, 4], [0, 2, 6]])
def test_keep_accepted_path_then_decode_matches_fresh_forward(tiny, tiny_llama, accepted) -> None:
    model = tiny_llama[0].model
    prompt = tiny.random_ids(PROMPT_LEN, seed=11)
    tokens = tiny.random_ids(len(PARENTS), seed=12)
    next_token = tiny.random_ids(1, seed=13)
    mask, depth = tree_mask_and_depth(PARENTS)

    cache = model.new_cache(PROMPT_LEN + len(PARENTS) + 1)
    model(prompt, cache)
    model(tokens, cache, positions=PROMPT_LEN + depth, tree_mask=mask)
    cache.keep(PROMPT_LEN, PROMPT_LEN + torch.tensor(accepted))
    assert cache.length == PROMPT_LEN + len(accepted)
    out = model(next_token, cache)  # default position: cache.length, right after the accepted path

    ref = tiny.native_forward(model, torch.cat([prompt, tokens[accepted], next_token]))
    torch.testing.assert_close(out.logits[-1], ref.logits[-1], atol=tiny.ATOL, rtol=0)
    torch.testing.assert_close(out.hidden[-1], ref.hidden[-1], atol=tiny.ATOL, rtol=0)


def test_without_compaction_the_next_token_would_differ(tiny, tiny_llama) -> None:
    """Guard: dropping the tree by truncation to the wrong length changes the result, so the test
    above depends on `keep` moving the right rows."""
    model = tiny_llama[0].model
    prompt = tiny.random_ids(PROMPT_LEN, seed=11)
    tokens = tiny.random_ids(len(PARENTS), seed=12)
    next_token = tiny.random_ids(1, seed=13)
    mask, depth = tree_mask_and_depth(PARENTS)
    accepted = [0, 2, 5]
    cache = model.new_cache(PROMPT_LEN + len(PARENTS) + 1)
    model(prompt, cache)
    model(tokens, cache, positions=PROMPT_LEN + depth, tree_mask=mask)
    cache.truncate(PROMPT_LEN + len(accepted))  # keeps tree rows 0, 1, 2 instead of 0, 2, 5
    out = model(next_token, cache)
    ref = tiny.native_forward(model, torch.cat([prompt, tokens[accepted], next_token]))
    assert not torch.allclose(out.logits[-1], ref.logits[-1], atol=1e-3)


def test_keep_moves_rows_in_every_layer() -> None:
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=8)
    for layer in range(2):
        rows = torch.arange(6, dtype=torch.float32)[None, :, None].expand(1, 6, 2) + 10 * layer
        cache.write(layer, rows, -rows)
    cache.advance(6)
    cache.keep(2, torch.tensor([2, 4, 5]))
    assert cache.length == 5
    for layer in range(2):
        assert cache.k[layer, 0, :5, 0].tolist() == [v + 10 * layer for v in (0, 1, 2, 4, 5)]
        assert cache.v[layer, 0, :5, 0].tolist() == [-(v + 10 * layer) for v in (0, 1, 2, 4, 5)]


def test_reserve_raises_capacity_exceeded_when_full(tiny, tiny_llama) -> None:
    model = tiny_llama[0].model
    cache = model.new_cache(8)
    model(tiny.random_ids(6), cache)
    cache.reserve(2)  # exactly full is fine
    with pytest.raises(CapacityExceeded, match="8"):
        cache.reserve(3)
    with pytest.raises(CapacityExceeded):
        model(tiny.random_ids(3), cache)
    assert cache.length == 6  # the failed forward wrote nothing
    model(tiny.random_ids(2), cache)
    assert cache.length == 8
    with pytest.raises(CapacityExceeded):
        model(tiny.random_ids(1), cache)
