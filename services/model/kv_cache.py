"""Preallocated per-sequence KV cache, shared by the target and the draft heads.

Layout (one tensor for K, one for V; B=1 as in the reference):

    k, v: [num_layers, num_kv_heads, capacity, head_dim]
          slot 0 ........ length-1 | length ....... capacity-1
          committed (or being-written) rows | free

A forward over T new tokens writes their K/V at slots [length, length+T) in every layer and then
advances `length` by T (`advance`). After tree verification, `keep` compacts the accepted nodes' rows
to the slots right after the committed prefix and drops the rest of the tree, as the reference's
`update_inference_inputs` does (eagle.md section 4). Does not know about tokens or positions.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.errors import CapacityExceeded


class KVRows(Protocol):
    """The KV cache interface a forward reads and writes: one sequence's rows. `KVCache` (below, one
    contiguous tensor per K and V) and `services.model.paged_kv.PagedCache` (a slot of the paged arena)
    both provide it; the model, the heads and the tree builder take either."""

    capacity: int  # rows reserved
    length: int  # rows in use

    def reserve(self, num_new: int) -> None: ...

    def advance(self, num_new: int) -> None: ...

    def truncate(self, length: int) -> None: ...

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def keep(self, start: int, slots: torch.Tensor) -> None: ...

    def grow(self, capacity: int) -> None: ...


class RowSpan:
    """The row bookkeeping every KV cache shares: `capacity` rows, the first `length` in use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0  # rows in use

    def reserve(self, num_new: int) -> None:
        """Raise before a forward that would overflow the preallocated slots."""
        if self.length + num_new > self.capacity:
            raise CapacityExceeded(
                f"KV cache holds {self.capacity} rows; {self.length} used, {num_new} more requested")

    def advance(self, num_new: int) -> None:
        self.length += num_new

    def truncate(self, length: int) -> None:
        """Forget every row at or after `length` (the draft drops its tree rows this way)."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


class KVCache(RowSpan):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(capacity)
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        # empty, not zeros: a row is always written before any forward reads it (reads stop at length + T)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [nKV, T, hd] at slots [length, length+T) of `layer`; return that layer's
        K and V over [0, length+T). WARNING: mutates the cache (not `length`: see `advance`)."""
        t = k_new.shape[1]
        end = self.length + t
        if k_new.requires_grad:
            # Training through the cache: copy first so tensors saved for backward stay intact.
            self.k, self.v = self.k.clone(), self.v.clone()
        self.k[layer, :, self.length:end] = k_new
        self.v[layer, :, self.length:end] = v_new
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def grow(self, capacity: int) -> None:
        """Reserve `capacity` rows (more than now): new tensors, the first `length` rows copied over.
        Example: capacity 300, length 280 -> grow(556): k, v become [L, nKV, 556, hd], rows 0..279 kept."""
        assert capacity > self.capacity, (capacity, self.capacity)
        shape = (*self.k.shape[:2], capacity, self.k.shape[3])
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.empty(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :, :self.length] = self.k[:, :, :self.length]
        v[:, :, :self.length] = self.v[:, :, :self.length]
        self.k, self.v, self.capacity = k, v, capacity

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Compact: copy the rows at absolute `slots` [n] (ascending; slots[i] >= start + i) to
        [start, start+n) and set length = start + n.

        Example: committed prefix 7, tree of 5 nodes at slots 7..11, accepted nodes [0, 2, 3]
        -> slots [7, 9, 10] move to [7, 8, 9]; length becomes 10."""
        n = int(slots.numel())
        assert start + n <= self.length, (start, n, self.length)
        idx = slots.to(self.k.device)
        # Gather first (a copy), then write: source and destination ranges may overlap.
        self.k[:, :, start:start + n] = self.k[:, :, idx]
        self.v[:, :, start:start + n] = self.v[:, :, idx]
        self.length = start + n
