"""KV slots that grow: a sequence reserves the rows it uses, not its worst case, and the youngest
sequence is preempted when the budget cannot hold another's growth.

    rows = first_rows(prompt_rows=300, capacity=4396, growth=256)         # 556 rows at Prefill
    rows = grow_to(length=550, rows=17, reserved=556, capacity=4396, growth=256)   # 823: 267 more
    victim = youngest({"a": 0, "b": 3, "c": 1})                           # "b": admitted last
    growth = SlotGrowth(rows=256, on_grow=..., on_preempt=...)           # the verifier's: grow(), not_found()

The verifier (services/engine/verifier.py) reserves `first_rows` at Prefill: the whole prompt (a
prompt sent in chunks: at its first chunk) and a growth increment (`--kv-growth-rows`, default
GROWTH_ROWS), never more than the sequence's capacity (prompt + max_new_tokens + one tree, what the
caller asked for). Before each step, every
Verify / Decode / prefill chunk that needs more rows than its slot holds grows the slot to
`grow_to` (the rows it needs plus one increment, at most its capacity), oldest sequence first, so
the running sequences grow before new Prefills of the same step take KV.

Preemption (vLLM's recompute preemption, LIFO): when the budget cannot hold a growth (not even the
rows the call itself needs), the youngest sequence (admitted last; the growing one itself when it
is the youngest) is preempted: its KV is released and its calls are answered with
SequencePreempted (NOT_FOUND), which a coordinator answers by prefilling the sequence again from
its committed tokens (coordinator/sequence_placement.py), so a preemption costs time, never a
committed token. The oldest sequence is never preempted while another one holds KV, and a Prefill
whose capacity exceeds the whole budget is refused at once, so the oldest sequence can always grow
to its capacity and finish: no deadlock. Deterministic: the same calls give the same victims.
The verifier service turns growth on (--kv-growth-rows); an in-process Verifier keeps growth 0
(worst-case reservation) unless told, since no coordinator would prefill a preempted sequence again.

Bookkeeping only: no tensors and no RPC; it reaches the KV through the runner's `grow` and the
verifier's `release`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from services.errors import PREEMPTED, KVBudgetExceeded, SequenceNotFound, SequencePreempted

GROWTH_ROWS = 256  # the default increment: several trees of a 60-node drafter, 16 pages of 16 rows


def first_rows(prompt_rows: int, capacity: int, growth: int) -> int:
    """KV rows a sequence reserves at Prefill: prompt + one increment, at most `capacity`
    (growth 0: `capacity`, the worst case). Example: (300, 4396, 256) -> 556; (300, 400, 256) -> 400."""
    return capacity if growth <= 0 else min(capacity, prompt_rows + growth)


def grow_to(length: int, rows: int, reserved: int, capacity: int, growth: int) -> int:
    """The rows a slot should hold before a call writes `rows` rows after `length` rows in use:
    `reserved` when they fit already, else length + rows + one increment, at most `capacity`.
    Example: (550, 17, 556, 4396, 256) -> 823; (550, 5, 556, 4396, 256) -> 556 (fits)."""
    if length + rows <= reserved:
        return reserved
    return min(capacity, length + rows + max(growth, 0))


def youngest(ages: dict[str, int]) -> str:
    """The sequence admitted last (`ages`: sequence id -> admission counter, larger = later)."""
    return max(ages, key=lambda seq_id: ages[seq_id])


class Slot(Protocol):
    """What growth reads and updates of a verifier's sequence (services/engine/verifier.py _Sequence)."""
    slot: int  # its KV slot in the runner's pool
    length: int  # rows in use
    reserved: int  # rows its slot holds
    capacity: int  # most rows it may use
    age: int  # admission counter (larger = later)


class Call(Protocol):
    @property
    def seq_id(self) -> str: ...

    @property
    def rows(self) -> int: ...


class SlotGrowth:
    """The verifier's growth increment, admission ages and preempted sequences (one per Verifier)."""

    PREEMPTED_KEPT = 4096  # preempted sequence ids remembered for their precise NOT_FOUND

    def __init__(self, rows: int, on_grow: Callable[[str, int], None] | None = None,
                 on_preempt: Callable[[str], None] | None = None) -> None:
        """`rows`: the growth increment (0: reserve the capacity at Prefill, never grow);
        `on_grow(seq_id, reserved)` after a slot grew, `on_preempt(seq_id)` after a preemption."""
        if rows < 0:
            raise ValueError(f"the KV growth increment must be >= 0 rows; got {rows}")
        self.rows = rows
        self.on_grow, self.on_preempt = on_grow, on_preempt
        self.preemptions = 0  # sequences preempted so far
        self._ages = itertools.count()
        self._preempted: OrderedDict[str, str] = OrderedDict()  # sequence id -> its NOT_FOUND message

    def first_rows(self, prompt_rows: int, capacity: int) -> int:
        return first_rows(prompt_rows, capacity, self.rows)

    def next_age(self) -> int:
        return next(self._ages)

    def admitted(self, seq_id: str) -> None:
        """`seq_id` was prefilled (again): no longer preempted."""
        self._preempted.pop(seq_id, None)

    def grow(self, seqs: Mapping[str, Slot], calls: Iterable[Call], runner, release: Callable[[str], None],
             budget: str) -> None:
        """Before a step: grow the slot of every call (Verify, Decode, prefill chunk) on a sequence of
        `seqs` that needs more rows than it holds (within its capacity), oldest sequence first; while
        the budget cannot hold even the rows a call needs, preempt the youngest sequence of `seqs`
        (`release(seq_id)` frees it; `budget` names the budget in the preempted sequence's message)."""
        needs: dict[str, int] = {}  # sequence id -> rows its (first) call writes
        for call in calls:
            seq = seqs.get(call.seq_id)
            if seq is not None and call.seq_id not in needs and seq.reserved < seq.length + call.rows <= seq.capacity:
                needs[call.seq_id] = call.rows
        for seq_id in sorted(needs, key=lambda s: seqs[s].age):
            seq = seqs.get(seq_id)
            while seq is not None and seq_id in seqs:
                wanted = grow_to(seq.length, needs[seq_id], seq.reserved, seq.capacity, self.rows)
                least = seq.length + needs[seq_id]  # the rows the call itself writes
                if self._grow(seq_id, seq, wanted, runner) or self._grow(seq_id, seq, least, runner):
                    break
                self._preempt(youngest({s: q.age for s, q in seqs.items()}), seqs, release, budget)

    def not_found(self, seq_id: str) -> SequenceNotFound:
        """The error for a call on `seq_id`, which the verifier does not hold."""
        why = self._preempted.get(seq_id)
        if why is not None:
            return SequencePreempted(why)
        return SequenceNotFound(f"unknown sequence {seq_id!r} on this verifier")

    def _grow(self, seq_id: str, seq: Slot, rows: int, runner) -> bool:
        """Grow `seq`'s slot to `rows` rows; False when the budget cannot hold them."""
        try:
            runner.grow(seq.slot, rows - seq.reserved)
        except KVBudgetExceeded:
            return False
        seq.reserved = rows
        if self.on_grow is not None:
            self.on_grow(seq_id, rows)
        return True

    def _preempt(self, seq_id: str, seqs: Mapping[str, Slot], release: Callable[[str], None], budget: str) -> None:
        """Release `seq_id`'s KV; its later calls get SequencePreempted until it is prefilled again."""
        self._preempted[seq_id] = (
            f"sequence {seq_id!r} {PREEMPTED}: its {seqs[seq_id].reserved} KV rows were released so that "
            f"older sequences could grow under {budget}; prefill it again from its committed tokens")
        while len(self._preempted) > self.PREEMPTED_KEPT:
            self._preempted.popitem(last=False)
        release(seq_id)
        self.preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq_id)
