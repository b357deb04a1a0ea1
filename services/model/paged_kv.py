"""A paged KV pool: every sequence's KV rows in one preallocated arena, found through a page table.

    pool = PagedKVPool(num_layers, num_kv_heads, head_dim, max_rows=65536, page_size=16, device="cuda")
    slot = pool.allocate(rows)        # ceil(rows / page_size) free pages; CapacityExceeded naming the budget
    pool.cache(slot)                  # a PagedCache: the KVCache interface over that slot's pages
    pool.rows_of(slot)                # [capacity] arena row of each of the slot's rows (host, numpy)
    pool.grow(slot, rows)             # `rows` more rows: the slot's last page, then new pages (nothing moves)
    pool.keep / truncate / length / capacity / release   as KVPool

Layout (one tensor for K, one for V, shared by every sequence):

    k, v: [num_layers, num_kv_heads, num_pages * page_size, head_dim]
    page 0 is the trash page: rows written by padding (a batch or a tree padded to a captured
    shape) land there and no real row ever reads it.

A sequence's logical row r lives at arena row pages[r // page_size] * page_size + r % page_size.
Because the arena never moves, a forward captured in a CUDA graph reads and writes any sequence's
rows through index tensors filled before each replay (services/model/uniform.py); the eager path
uses `PagedCache`, which gathers a sequence's rows into [nKV, S, hd] for the attention kernels.
Allocation is deterministic (lowest free pages first), as KVPool's, so tensor-parallel ranks that
replay the same calls agree on slots and pages. Does not know about tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from services.model.kv_cache import RowSpan
from services.model.kv_pool import KVPool
from services.model.transfer import to_device_queued

TRASH_ROW = 0  # the first row of the trash page


class PagedCache(RowSpan):
    """One slot of a PagedKVPool behind the KVCache interface (reserve, write, advance, truncate,
    keep, length, capacity), so the eager forward serves paged and contiguous KV alike."""

    def __init__(self, pool: PagedKVPool, rows: np.ndarray) -> None:
        super().__init__(int(rows.shape[0]))
        self.pool = pool
        self.rows_host = rows  # [capacity] int64 arena rows
        self.rows = torch.from_numpy(rows).to(pool.device)  # [capacity] the same on the pool's device

    def grow(self, capacity: int) -> None:
        """Take `capacity` rows of the slot's pages (PagedKVPool.grow added the pages): the rows in
        use keep their arena rows, so nothing is copied and a captured graph's page table is refilled
        from `rows_host` at its next replay."""
        rows = self.pool.arena_rows(self.pool.pages_of(self))[:capacity]
        assert capacity > self.capacity and np.array_equal(rows[:self.capacity], self.rows_host), capacity
        self.rows_host = rows
        self.rows = torch.from_numpy(rows).to(self.pool.device)
        self.capacity = capacity

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [nKV, T, hd] at logical rows [length, length+T); return the layer's K and V over
        logical rows [0, length+T) as [nKV, length+T, hd] (gathered copies). Does not advance."""
        end = self.length + int(k_new.shape[1])
        dst = self.rows[self.length:end]
        k, v = self.pool.k[layer], self.pool.v[layer]
        k.index_copy_(1, dst, k_new.to(k.dtype))
        v.index_copy_(1, dst, v_new.to(v.dtype))
        rows = self.rows[:end]
        return k.index_select(1, rows), v.index_select(1, rows)

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Compact: logical rows `slots` [n] (ascending, slots[i] >= start + i) move to [start, start+n);
        length = start + n (KVCache.keep). One gather and one scatter on the device."""
        n = int(slots.numel())
        assert start + n <= self.length, (start, n, self.length)
        src = to_device_queued(torch.from_numpy(self.rows_host[slots.cpu().numpy()]), self.rows.device)  # arena rows
        dst = self.rows[start:start + n]
        for arena in (self.pool.k, self.pool.v):
            arena[:, :, dst] = arena[:, :, src]  # the gather copies first: overlapping ranges are safe
        self.length = start + n


class PagedKVPool(KVPool):
    """KVPool's interface and budget (rows allocated <= max_rows) over one arena of pages."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_rows: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", page_size: int = 16) -> None:
        if max_rows is None or max_rows < 1:
            raise ValueError(f"a paged KV pool needs max_rows >= 1 (its arena is preallocated); got {max_rows}")
        super().__init__(num_layers, num_kv_heads, head_dim, max_rows, dtype, device)
        self.page_size = page_size
        self.num_pages = 1 + -(-max_rows // page_size)  # + the trash page
        shape = (num_layers, num_kv_heads, self.num_pages * page_size, head_dim)
        # zeros, not empty: padded rows may read rows nothing wrote, and must read finite values
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(self.num_pages - 1, 0, -1))  # a stack: pop() gives the lowest page
        self._pages: dict[int, list[int]] = {}

    @classmethod
    def for_model(cls, target, max_rows: int | None = None, page_size: int = 16) -> PagedKVPool:
        c = target.config
        if max_rows is None:
            max_rows = default_rows(target)
        return cls(c.num_layers, target.model.layers[0].self_attn.num_kv_heads, c.head_dim, max_rows,
                   target.dtype, target.device, page_size)

    def allocate(self, rows: int) -> int:
        if rows < 1:
            raise ValueError(f"a KV slot needs rows >= 1; got {rows}")
        pages = -(-rows // self.page_size)
        if not self.fits(rows) or pages > len(self._free):
            raise self.refusal(rows)
        slot = next(i for i in range(len(self._slots) + 1) if i not in self._slots)
        taken = sorted(self._free.pop() for _ in range(pages))
        self._pages[slot] = taken
        self._slots[slot] = PagedCache(self, self.arena_rows(taken)[:rows])
        self._rows_allocated += rows
        return slot

    def grow(self, slot: int, rows: int) -> None:
        """`rows` more rows for `slot`: the free rows of its last page first, then the lowest free
        pages; KVBudgetExceeded (nothing changed) when the budget or the arena has no room."""
        if rows < 1:
            raise ValueError(f"a KV slot grows by rows >= 1; got {rows}")
        cache = self.paged(slot)
        capacity = cache.capacity + rows
        pages = -(-capacity // self.page_size) - len(self._pages[slot])
        if not self.fits(rows) or pages > len(self._free):
            raise self.refusal(rows)
        self._pages[slot] += sorted(self._free.pop() for _ in range(pages))
        cache.grow(capacity)
        self._rows_allocated += rows

    def arena_rows(self, pages: list[int]) -> np.ndarray:
        """[len(pages) * page_size] int64: the arena rows of `pages`, in order."""
        p = self.page_size
        return (np.asarray(pages, dtype=np.int64)[:, None] * p + np.arange(p, dtype=np.int64)[None]).reshape(-1)

    def pages_of(self, cache: PagedCache) -> list[int]:
        """The pages of the slot whose cache is `cache`."""
        return next(self._pages[s] for s, c in self._slots.items() if c is cache)

    def release(self, slot: int) -> None:
        cache = self._slots.pop(slot, None)
        if cache is not None:
            self._rows_allocated -= cache.capacity
            self._free.extend(self._pages.pop(slot))
            self._free.sort(reverse=True)

    def paged(self, slot: int) -> PagedCache:
        """`slot`'s cache (a PagedCache: every slot of this pool is one)."""
        cache = self._slots[slot]
        assert isinstance(cache, PagedCache)
        return cache

    def rows_of(self, slot: int) -> np.ndarray:
        """[capacity] int64 arena row of each logical row of `slot` (host)."""
        return self.paged(slot).rows_host


def default_rows(target, share: float = 0.5, cap: int = 1 << 20) -> int:
    """Rows of a paged pool built without a budget: on a GPU, `share` of the memory free now (at
    most `cap` rows); on the CPU, the model's context for 8 sequences."""
    c = target.config
    elem = torch.empty((), dtype=target.dtype).element_size()
    per_row = 2 * c.num_layers * target.model.layers[0].self_attn.num_kv_heads * c.head_dim * elem
    if target.device.type == "cuda":
        free = torch.cuda.mem_get_info(target.device)[0]
        return max(1, min(cap, int(free * share) // per_row))
    return min(cap, 8 * c.max_context)
