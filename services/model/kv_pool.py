"""A pool of KV slots: the target's KV for many sequences, one slot per sequence.

    pool = KVPool(num_layers, num_kv_heads, head_dim, max_rows=4096)
    slot = pool.allocate(rows)       # lowest free slot id; CapacityExceeded naming the budget
    pool.cache(slot)                 # that slot's KVCache: k, v [num_layers, num_kv_heads, rows, head_dim]
    pool.keep(slot, start, rows [n]) # compaction of an accepted path (a per-slot gather)
    pool.grow(slot, rows)            # reserve `rows` more rows for the slot; KVBudgetExceeded when they do not fit
    pool.truncate(slot, length); pool.length(slot); pool.release(slot)

Each slot is a preallocated `KVCache` of the rows asked for at `allocate` (the verifier asks for the
prompt and a growth increment, services/engine/kv_growth.py), created when the slot is allocated,
reallocated larger by `grow` (the rows in use copied over) and dropped when it is released, so
memory follows the rows the sequences reserved, not a worst case. `max_rows` (None =
unbounded) is the pool's budget: the sum of the rows of all allocated slots never exceeds it, so a
sequence whose KV does not fit is refused at `allocate`, never partially admitted. `bytes_per_row`
converts a memory budget into rows (K and V, every layer).

Deterministic: the same sequence of calls gives the same slot ids (the lowest free id), so every rank
of a tensor-parallel group that replays the same calls agrees on them. Does not know about tokens.
"""

from __future__ import annotations

import torch

from services.errors import KVBudgetExceeded
from services.model.kv_cache import KVCache, KVRows


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_rows: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"a KV pool needs max_rows >= 1 (or None); got {max_rows}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_rows = max_rows
        self._slots: dict[int, KVRows] = {}
        self._rows_allocated = 0

    @classmethod
    def for_model(cls, target, max_rows: int | None = None) -> KVPool:
        """A pool shaped for `target` (a TargetModel: its layers, KV heads, head_dim, dtype, device)."""
        c = target.config
        # the layers' own KV heads: fewer than the config's on a tensor-parallel shard (services/model/tp.py)
        return cls(c.num_layers, target.model.layers[0].self_attn.num_kv_heads, c.head_dim, max_rows,
                   target.dtype, target.device)

    @property
    def bytes_per_row(self) -> int:
        """Bytes one KV row takes: K and V of every layer and KV head."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def rows_allocated(self) -> int:
        return self._rows_allocated

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def budget_text(self) -> str:
        if self.max_rows is None:
            return "an unbounded KV pool"
        mib = self.max_rows * self.bytes_per_row / 2 ** 20
        return f"the KV budget of {self.max_rows} rows ({mib:.1f} MiB at {self.bytes_per_row} bytes/row)"

    def fits(self, rows: int) -> bool:
        return self.max_rows is None or self._rows_allocated + rows <= self.max_rows

    def refusal(self, rows: int) -> KVBudgetExceeded:
        """The error for `rows` rows that do not fit, naming the budget and what holds it."""
        return KVBudgetExceeded(
            f"KV for {rows} rows does not fit {self.budget_text()}: {self._rows_allocated} rows are "
            f"held by {len(self._slots)} sequences", fits_empty=rows <= (self.max_rows or 0))

    def allocate(self, rows: int) -> int:
        """A slot of `rows` KV rows (length 0): the lowest free slot id."""
        if rows < 1:
            raise ValueError(f"a KV slot needs rows >= 1; got {rows}")
        if not self.fits(rows):
            raise self.refusal(rows)
        slot = next(i for i in range(len(self._slots) + 1) if i not in self._slots)
        self._slots[slot] = KVCache(self.num_layers, self.num_kv_heads, self.head_dim, rows,
                                    self.dtype, self.device)
        self._rows_allocated += rows
        return slot

    def grow(self, slot: int, rows: int) -> None:
        """Reserve `rows` more rows for `slot` (its rows in use stay where they are, logically);
        KVBudgetExceeded (nothing changed) when they do not fit the budget."""
        if rows < 1:
            raise ValueError(f"a KV slot grows by rows >= 1; got {rows}")
        cache = self.cache(slot)
        if not self.fits(rows):
            raise self.refusal(rows)
        cache.grow(cache.capacity + rows)
        self._rows_allocated += rows

    def release(self, slot: int) -> None:
        """Free `slot` (unknown slots are ignored: release is idempotent)."""
        cache = self._slots.pop(slot, None)
        if cache is not None:
            self._rows_allocated -= cache.capacity

    def cache(self, slot: int) -> KVRows:
        try:
            return self._slots[slot]
        except KeyError:
            raise KeyError(f"KV slot {slot} is not allocated") from None

    def length(self, slot: int) -> int:
        return self.cache(slot).length

    def capacity(self, slot: int) -> int:
        return self.cache(slot).capacity

    def keep(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Compact: the rows at absolute indices `rows` [n] (ascending, rows[i] >= start + i) move
        to [start, start + n); the slot's length becomes start + n (KVCache.keep)."""
        self.cache(slot).keep(start, torch.as_tensor(rows, dtype=torch.long))

    def truncate(self, slot: int, length: int) -> None:
        self.cache(slot).truncate(length)
