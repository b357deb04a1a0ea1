"""The cost model: seconds per call against rows for one target forward (tree attention) and one
draft-head step on this device, piecewise linear between measured row counts.

  * t_verify(rows)  one target forward over `rows` tree nodes (tree attention) + acceptance
  * t_head(rows)    the draft head's layer alone over `rows` rows (extending the draft KV with
                    committed rows)
  * t_draft(rows)   one draft step: head layer + projection + log-softmax over `rows` rows

Pure: curves are values. Measuring them on a device and caching them on disk is
services/engine/calibration.py's job.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from services.errors import InvalidRequest
from services.spec.tree import TreeParams


@dataclass(frozen=True, slots=True)
class CostCurve:
    """Seconds per call against rows, measured at `rows` (ascending); linear between points and
    beyond the last two, clamped at the first point below it."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.seconds) or not self.rows:
            raise InvalidRequest(f"cost curve needs as many seconds as rows; got {len(self.rows)} rows, "
                                 f"{len(self.seconds)} seconds")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:], strict=False)):
            raise InvalidRequest(f"cost curve rows must ascend; got {list(self.rows)}")
        if any(not (s >= 0 and math.isfinite(s)) for s in self.seconds):
            raise InvalidRequest(f"cost curve seconds must be finite and >= 0; got {list(self.seconds)}")

    def __call__(self, rows: float) -> float:
        r, s = self.rows, self.seconds
        if rows <= r[0] or len(r) == 1:
            return s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (rows - r[i - 1]) / (r[i] - r[i - 1])
        slope = (s[-1] - s[-2]) / (r[-1] - r[-2])
        return s[-1] + max(slope, 0.0) * (rows - r[-1])

    def top_slope(self) -> float:
        """Seconds per extra row between the two largest measured row counts (>= 0): on a CPU the
        compute-bound cost of a row, on a GPU small until far more rows."""
        r, s = self.rows, self.seconds
        return max(0.0, (s[-1] - s[-2]) / (r[-1] - r[-2])) if len(r) > 1 else 0.0

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "seconds": list(self.seconds)}

    @staticmethod
    def from_dict(d: dict) -> CostCurve:
        return CostCurve(tuple(int(x) for x in d["rows"]), tuple(float(x) for x in d["seconds"]))


ZERO = CostCurve((1,), (0.0,))


@dataclass(frozen=True, slots=True)
class CostModel:
    verify: CostCurve  # target forward over `rows` tree nodes + acceptance, seconds
    head: CostCurve = ZERO  # draft head layer over `rows` rows (no projection)
    logits: CostCurve = ZERO  # draft projection + log-softmax over `rows` rows

    def t_verify(self, rows: float) -> float:
        return self.verify(rows)

    def t_draft(self, rows: float) -> float:
        """One draft step: head layer + projection over `rows` rows."""
        return self.head(rows) + self.logits(rows)

    def draft_seconds(self, params: TreeParams, commit_rows: float) -> float:
        """Extend the draft KV with `commit_rows` rows, project the last, expand `depth` levels."""
        return self.head(commit_rows) + self.logits(1) + params.depth * self.t_draft(params.top_k)

    def to_dict(self) -> dict:
        return {"verify": self.verify.to_dict(), "head": self.head.to_dict(), "logits": self.logits.to_dict()}

    @staticmethod
    def from_dict(d: dict) -> CostModel:
        return CostModel(CostCurve.from_dict(d["verify"]), CostCurve.from_dict(d["head"]),
                         CostCurve.from_dict(d["logits"]))


def batch_verify(costs: CostModel, others: float, rows: float) -> float:
    """One target forward over the others' rows plus `rows` of this sequence. Beyond its first row,
    each row costs at least the curve's top slope (the compute-bound cost of a row): a curve measured
    on a busy machine can be flat over a range of rows, and such a flat range must not make a
    batch's extra tree rows look free."""
    first = costs.t_verify(others + 1)
    return max(costs.t_verify(others + rows), first + costs.verify.top_slope() * (rows - 1))


@functools.lru_cache(maxsize=16)
def verify_table(costs: CostModel, n: int) -> tuple[float, ...]:
    """(0, t_verify(1), ..., t_verify(n))."""
    return (0.0,) + tuple(costs.t_verify(r) for r in range(1, n + 1))


@functools.lru_cache(maxsize=256)
def batch_verify_table(costs: CostModel, others: float, n: int) -> tuple[float, ...]:
    """(0, batch_verify(others, 1), ..., batch_verify(others, n)): the others' rows take few values."""
    return (0.0,) + tuple(batch_verify(costs, others, r) for r in range(1, n + 1))
