"""What one target forward over many sequences is asked, and what it returns.

    Step(entries=(StepEntry(slot, input_ids [T_i], positions [T_i], tree_mask [T_i, T_i] | None,
                            logits "all" | "last"), ...), want_taps)
    StepOutput(logits (per entry [T_i or 1, V]), hidden [R, H], taps [R, 3H] | None,
               offsets (entry i's rows are [offsets[i], offsets[i+1]) of hidden and taps))

One Step = one target forward (`ModelRunner.execute`) that serves prefills, plain decodes and
verification trees of many sequences at once: R = sum of T_i rows go through every linear layer as
one GEMM; each entry's rows attend to its own KV slot (the rows committed there) plus, among
themselves, the causal triangle (tree_mask None) or the tree mask. Each entry's new K/V rows are
written at its slot's next free rows and the slot's length advances by T_i.

Plain data, picklable (a tensor-parallel group proxy sends a Step to every rank); tensors are on the
CPU or the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True, slots=True)
class StepEntry:
    slot: int  # KV slot of the sequence (KVPool.allocate)
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor | None = None  # [T] absolute positions; None = slot length + arange(T)
    tree_mask: torch.Tensor | None = None  # [T, T] bool ancestors-or-self; None = causal
    logits: Literal["all", "last"] = "all"  # logits of every row, or of the last row only

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class Step:
    entries: tuple[StepEntry, ...]
    want_taps: bool = False  # also return the EAGLE-3 taps of every row

    @property
    def rows(self) -> int:
        return sum(e.rows for e in self.entries)


@dataclass(frozen=True, slots=True)
class StepOutput:
    logits: tuple[torch.Tensor, ...]  # per entry: [T_i, V] ("all") or [1, V] ("last"), fp32
    hidden: torch.Tensor  # [R, H] post-final-norm features of every row (EAGLE-1/2)
    taps: torch.Tensor | None  # [R, 3H] EAGLE-3 taps of every row, when asked for
    offsets: tuple[int, ...]  # len(entries) + 1 row offsets into hidden / taps

    def hidden_of(self, i: int) -> torch.Tensor:
        """[T_i, H] entry i's hidden rows."""
        return self.hidden[self.offsets[i]:self.offsets[i + 1]]

    def taps_of(self, i: int) -> torch.Tensor | None:
        """[T_i, 3H] entry i's taps (None when not asked for)."""
        return None if self.taps is None else self.taps[self.offsets[i]:self.offsets[i + 1]]
