"""Which queued calls one forward (a *step*) serves: decodes first, then prefill rows up to a token
budget (vLLM's chunked-prefill policy).

    budget = step_rows(cost, itl_target_s=0.2, floor=32, cap=1024)   # rows one step may hold
    picked = pick(queued, max_calls=16, max_rows=1024, budget=budget, starved=False)
    # -> indices into `queued`, ascending (arrival order)
    step = plan(queued, 16, 1024, budget)   # the same, and which prefill runs only its first rows
    # -> Step(picked=[0, 2], cut=(2, 90)): call 2 runs its first 90 rows now, the rest next step

Vocabulary:
  * step        one target forward over the calls the batcher hands to run_batch together.
  * decode row  a row of a Verify or Decode call: a running sequence's next tokens (tree nodes or one
                token). Its neighbours' inter-token latency (ITL) is the time between its steps.
  * prefill row a prompt row of a Prefill chunk.
  * slice       the first rows of a prefill call that a step cuts to fit its budget (a `splittable`
                call: the verifier's prefill calls); the rest stays queued in the call's place and
                runs in the next steps, so a 512-row chunk is one RPC but several forwards when
                decodes run next to it, and one forward when none does.
  * budget      the rows a step may hold so that it stays within the ITL target: the largest row count
                whose measured forward time t_verify(rows) is at most the target, never below `floor`
                (a CPU whose single-row forward already misses the target must still make progress
                on prompts) and never above `cap`.

Policy of `pick`, over the calls queued up to the first barrier:
  1. every decode call, in arrival order (one call per key: a sequence's second call waits for the
     next step), up to `max_calls` calls and `max_rows` rows: a running sequence is never passed over
     for a prompt;
  2. then prefill calls, in arrival order, while decode rows + prefill rows stay within `budget`
     (and `max_rows`, `max_calls`);
  within each kind no call overtakes an older one that did not fit (it would wait forever behind
  smaller ones);
  3. a prefill that was passed over for several steps in a row (`starved`, the batcher counts) joins
     even beyond the budget (within `max_rows`): decodes that fill every step cannot starve a prompt;
  4. a call larger than `max_rows` runs alone: at the head of the queue, or as the starved prefill;
     a step never comes out empty (with nothing picked, the oldest call runs);
  5. (`plan` only) the first splittable prefill that does not fit the budget left is cut: its first
     max(budget left, budget // 2) rows run in this step (at least half the budget goes to the
     prompt, so the rows per step, and with them a prompt's time to its first token, do not
     collapse when decodes nearly fill the budget: a step may exceed the budget by that much).

The budget applies only while a sequence decodes here (the batcher passes budget None otherwise): a
prompt prefilling alone runs whole chunks, one forward each. `step_rows` is a budget fixed from the
start-up curve t_verify(rows) (a tree forward after a 128-row prefix); the verifier sizes each step
instead from the cost learned from the steps that ran, with each call's `prefix` (a slice at a long
offset attends to the whole prefix): services/engine/step_cost.py.

Pure: no threads, no clocks, no model; the batcher (services/engine/batcher.py) calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

STARVE_STEPS = 4  # steps a waiting prefill may be passed over before it joins beyond the budget


@dataclass(frozen=True, slots=True)
class Queued:
    """One queued call, as the scheduler sees it."""

    rows: int  # rows it adds to the forward (prompt rows, tree nodes, 1 for a decode)
    prefill: bool  # a Prefill chunk (True) or a decode/verify of a running sequence (False)
    key: Hashable  # its sequence: a step holds one call per key
    splittable: bool = False  # a prefill call whose first rows may run alone (rule 5)
    prefix: int = 0  # rows its sequence holds in KV before this call (each new row attends to them)


@dataclass(frozen=True, slots=True)
class Step:
    """What one step runs: `picked` indices into the queue (ascending); `cut` = (index, rows) when
    that picked prefill call runs only its first `rows` rows in this step."""

    picked: list[int]
    cut: tuple[int, int] | None = None


def step_rows(cost: Callable[[float], float], itl_target_s: float, floor: int, cap: int) -> int:
    """The largest rows r in [floor, cap] with cost(r) <= itl_target_s (floor when even that misses it).
    `cost` must not decrease with rows (a CostCurve). Example: cost = 0.05 + 0.001 * r, target 0.2 s,
    floor 8, cap 1024 -> 150."""
    floor = max(1, min(floor, cap))
    if cost(floor) > itl_target_s:
        return floor
    lo, hi = floor, cap  # cost(lo) <= target; find the last such row count by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= itl_target_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pick(queued: Sequence[Queued], max_calls: int, max_rows: int, budget: int | None,
         starved: bool = False) -> list[int]:
    """This step's calls: indices into `queued` (the calls before the first barrier, oldest first),
    ascending. `budget` None = no token budget (prefill rows bounded by `max_rows` only)."""
    return plan(queued, max_calls, max_rows, budget, starved).picked


def plan(queued: Sequence[Queued], max_calls: int, max_rows: int, budget: int | None,
         starved: bool = False) -> Step:
    """`pick`, and the slice of rule 5: with a budget, the first splittable prefill that does not
    fit runs its first rows. Example: budget 100, a 16-row decode queued after a 512-row splittable
    prefill -> Step(picked=[0, 1], cut=(0, 84))."""
    if not queued:
        return Step([])
    if queued[0].rows > max_rows and not (queued[0].splittable and budget is not None):  # 4. alone
        return Step([0])
    if starved:
        oldest = next((i for i, q in enumerate(queued) if q.prefill), None)
        if oldest is not None and queued[oldest].rows > max_rows and not queued[oldest].splittable:
            return Step([oldest])
    limit = max_rows if budget is None else min(budget, max_rows)
    picked: list[int] = []
    keys: set[Hashable] = set()
    cut: tuple[int, int] | None = None
    rows = 0
    for i, q in enumerate(queued):  # 1. every decode
        if q.prefill or q.key in keys:
            continue
        if len(picked) >= max_calls or rows + q.rows > max_rows:
            break  # no overtaking: a later, smaller call does not pass this one
        picked.append(i)
        keys.add(q.key)
        rows += q.rows
    for i, q in enumerate(queued):  # 2. prefill rows within the budget; 3. a starved one beyond it
        if not q.prefill or q.key in keys:
            continue
        if len(picked) >= max_calls:
            break
        if rows + q.rows <= limit or (starved and rows + q.rows <= max_rows):
            picked.append(i)
            keys.add(q.key)
            rows += q.rows
            starved = False  # one starved prompt per step
            continue
        if q.splittable and budget is not None:  # 5. its first rows
            first = min(max(limit - rows, budget // 2, 1), max_rows - rows)
            if 0 < first < q.rows:
                picked.append(i)
                cut = (i, first)
        break  # prompts in arrival order
    if not picked:  # 4. never an empty step
        picked.append(0)
    return Step(sorted(picked), cut)
