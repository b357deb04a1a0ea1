"""`ancestors` (one pass over parent chains) equals the per-node definition of the ancestor mask, and
its depths are the mask's row sums minus one, on random, chain and star trees."""

import torch

from services.spec.tree import ancestors


def reference_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def test_ancestors_equal_the_per_node_loop():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 16, 60, 200):
        for shape in ("random", "chain", "star"):
            if shape == "chain":
                parents = [-1] + list(range(n - 1))
            elif shape == "star":
                parents = [-1] + [0] * (n - 1)
            else:
                parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
            depths, got = ancestors(parents)
            want = reference_mask(parents)
            assert torch.equal(got, want), (n, shape)
            assert torch.equal(depths, want.sum(dim=1) - 1), (n, shape)
