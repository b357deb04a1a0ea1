"""KV slots that grow: a sequence reserves the rows it uses, not its worst case, and the youngest
sequence is preempted when the budget cannot hold another's growth.

    rows = first_rows(prompt_rows=300, capacity=4396, growth=256)         # 556 rows at Prefill
    rows = grow_to(length=550, rows=17, reserved=556, capacity=4396, growth=256)   # 823: 267 more
    victim = youngest({"a": 0, "b": 3, "c": 1})                           # "b": admitted last

The verifier (services/engine/verifier.py) reserves `first_rows` at Prefill: the prompt and a
growth increment (`--kv-growth-rows`, default GROWTH_ROWS), never more than the sequence's
capacity (prompt + max_new_tokens + one tree, what the caller asked for). Before each step, every
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

Pure bookkeeping: no tensors, no pool, no RPC.
"""

from __future__ import annotations

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
