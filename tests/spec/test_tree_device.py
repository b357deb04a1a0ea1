"""`ancestor_mask` (no per-node Python loop) equals the per-node definition on random trees."""

import torch

from services.spec.tree import ancestor_mask


def reference_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def test_ancestor_mask_equals_the_per_node_loop():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 16, 60, 200):
        for shape in ("random", "chain", "star"):
            if shape == "chain":
                parents = [-1] + list(range(n - 1))
            elif shape == "star":
                parents = [-1] + [0] * (n - 1)
            else:
                parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
            got = ancestor_mask(torch.tensor(parents))
            assert torch.equal(got, reference_mask(parents)), (n, shape)
