"""What one step (one target forward) costs, learned online from the steps that ran, and the token
budget that keeps the next step within the ITL target.

    cost = StepCost.from_curve(verify_cost)                  # seeded from the start-up curve
    budget = StepBudget(cost, target_s=0.45, floor=32, cap=1024)
    rows = budget.rows(queued)     # this step's budget: decode rows + the prefill rows that fit
    budget.observe(ran, seconds)   # after the forward: the Queued calls it ran, its wall time

The model (per step, over its calls i with `rows_i` new rows after `prefix_i` rows already in KV):

    t = a + b * rows + c * attended,   rows = sum rows_i,   attended = sum rows_i * (prefix_i + (rows_i + 1) / 2)

`a` is a forward's fixed cost (weights read once, the logits of a decode row, Python), `b` a row's
cost through the linears, `c` one (query, key) pair of attention: a slice at a long offset attends
to the whole prefix, so 100 rows at offset 8,000 cost far more than 100 rows at offset 0. Worked
example: a 1-row decode after 300 rows and a 100-row slice at offset 4,000 -> rows 101, attended
1 * 301 + 100 * 4050.5 = 405,351.

Fitted by least squares over the last `window` steps, pulled toward the prior (the start-up curve
t_verify(rows) after a 128-row prefix: its a and b; c = 0) with weight `prior_weight` on the
slopes b and c only (ROW_UNIT rows, PAIR_UNIT pairs a unit); the intercept is free, so the
window's mean step time is met without the prior's bias. Robust to a step disturbed by
other load: the fit drops the steps whose residual passes TRIM x the window's median residual and
fits again (a 10x step among 20 ordinary ones leaves no trace). Why online: the start-up curve
is measured once, often on a loaded machine, and at a 128-row prefix only; on the 2-core CPU of
docs/distributed.md it put 46-row steps at 500 ms that really took about 315 ms.

Pure: no clocks, no threads, no model; the batcher calls `rows` and `observe` on its worker thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.engine.step_scheduler import Queued
from services.errors import InvalidRequest
from services.spec.cost import CostCurve

ROW_UNIT = 64.0  # rows per unit of the `rows` feature
PAIR_UNIT = 64.0 * 1024.0  # (query, key) pairs per unit of the `attended` feature
AUTO_RATIO = 3.0  # auto target: a step beside a prompt costs at most this many plain steps
PLAIN_WINDOW = 16  # auto target: the plain (decode-only) steps whose median is a plain step's time
TRIM = 4.0  # a step whose residual passes TRIM x the window's median residual leaves the fit


def attended(rows: int, prefix: int) -> float:
    """(query, key) pairs of `rows` causal rows after `prefix` rows: rows * (prefix + (rows + 1) / 2).
    Example: 4 rows after 10 -> 4 * 12.5 = 50 (11 + 12 + 13 + 14)."""
    return rows * (prefix + (rows + 1) / 2)


def pair_flops(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """FLOPs of one attended (query, key) pair over FLOPs of one row through a layer's linears: the
    prior's c / b. Per layer a pair costs 4 * heads * head_dim (q.k and p.v), a row 2 * (the q, k,
    v, o and MLP weights). SmolLM2-135M (576, 1536, 9, 3, 64) -> 2304 / 7,077,888 = 3.3e-4 (measured
    on the 2-core CPU of docs/distributed.md: 5e-4, attention runs below the linears' FLOP rate)."""
    q = heads * head_dim
    weights = hidden * q * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return 4 * q / (2 * weights)


def shape(calls: Sequence[Queued]) -> tuple[int, float]:
    """(rows, attended) of a step over `calls`."""
    return sum(q.rows for q in calls), sum(attended(q.rows, q.prefix) for q in calls)


class StepCost:
    """t(rows, attended) = a + b * rows + c * attended (seconds), fitted online."""

    def __init__(self, a: float, b: float, c: float = 0.0, window: int = 32, prior_weight: float = 0.25) -> None:
        """The prior (a, b, c): seconds, seconds per row, seconds per attended pair."""
        if not (a >= 0 and b >= 0 and c >= 0):
            raise InvalidRequest(f"step cost prior must be >= 0; got a={a}, b={b}, c={c}")
        if window < 3 or not prior_weight > 0:
            raise InvalidRequest(f"window must be >= 3 and prior_weight > 0; got {window}, {prior_weight}")
        self._prior = np.array([a, b * ROW_UNIT, c * PAIR_UNIT])  # [3] in unit seconds
        self._theta = self._prior.copy()  # [3] the current fit, unit seconds
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)  # (rows unit, pairs unit, s)
        self.prior_weight = prior_weight
        self.steps = 0  # steps observed so far

    @classmethod
    def from_curve(cls, curve: CostCurve, pair_per_row: float = 0.0, **kw) -> StepCost:
        """The prior from the start-up curve t_verify(rows) (after a 128-row prefix): a least-squares
        line through its points (a >= 0, b > 0), and c = b * `pair_per_row` (an attended pair's share
        of a row's cost, e.g. `pair_flops(config)`: the curve, at one prefix, cannot tell). Example:
        points (1, 0.051), (1000, 1.05) -> a 0.05, b 0.001, c 0."""
        r = np.array(curve.rows, dtype=float)
        t = np.array(curve.seconds, dtype=float)
        if len(r) == 1:
            return cls(t[0], 0.0, **kw)
        b, a = np.polyfit(r, t, 1)
        b = max(float(b), 1e-9)
        a = max(float(a), 0.0)
        return cls(a, b, b * pair_per_row, **kw)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a seconds, b seconds per row, c seconds per attended pair) of the current fit."""
        a, b, c = self._theta
        return float(a), float(b / ROW_UNIT), float(c / PAIR_UNIT)

    def predict(self, rows: float, pairs: float) -> float:
        """Seconds of a step of `rows` rows attending `pairs` (query, key) pairs."""
        return float(self._theta @ np.array([1.0, rows / ROW_UNIT, pairs / PAIR_UNIT]))

    def observe(self, rows: int, pairs: float, seconds: float) -> None:
        """One step that ran: its rows, attended pairs and wall time; refits."""
        if not (seconds >= 0 and rows >= 0):
            return  # a clock that went back, nothing to learn
        self._obs.append((rows / ROW_UNIT, pairs / PAIR_UNIT, seconds))
        self.steps += 1
        self._fit()

    def _fit(self) -> None:
        obs = np.array(self._obs)  # [n, 3]: rows unit, pairs unit, seconds
        x = np.column_stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]])  # [n, 3]
        t = obs[:, 2]  # [n]
        theta = self._solve(x, t)
        resid = np.abs(x @ theta - t)
        typical = max(float(np.median(resid)), 0.02 * float(np.median(t)))  # perfect data: a 2% floor
        keep = resid <= TRIM * typical
        if not keep.all():
            theta = self._solve(x[keep], t[keep])
        self._theta = theta

    def _solve(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Least squares with the slopes pulled toward the prior's: minimise
        |x theta - t|^2 + w (|theta_b - prior_b|^2 + |theta_c - prior_c|^2), the intercept free (so
        the steps' mean time is met without the prior's bias; the slopes keep the prior's along what
        the window does not vary). A coefficient that comes out below its bound (a >= 0, b > 0,
        c >= 0: the budget's bisection needs a cost that grows with rows) is pinned at it and the
        others fitted again."""
        lower = np.array([0.0, 1e-9 * ROW_UNIT, 0.0])
        penalty = np.array([0.0, self.prior_weight, self.prior_weight])
        pinned: dict[int, float] = {}
        while True:
            free = [j for j in range(3) if j not in pinned]
            rest = t - sum((x[:, j] * v for j, v in pinned.items()), np.zeros_like(t))  # [n]
            xf = x[:, free]  # [n, len(free)]
            p = np.diag(penalty[free])
            theta_f = np.linalg.solve(xf.T @ xf + p + 1e-12 * np.eye(len(free)),
                                      xf.T @ rest + p @ self._prior[free])
            theta = np.empty(3)
            theta[free] = theta_f
            for j, v in pinned.items():
                theta[j] = v
            low = [j for j in free if theta[j] < lower[j]]
            if not low:
                return theta
            j = min(low, key=lambda k: theta[k] - lower[k])  # the worst one first
            pinned[j] = lower[j]


@dataclass
class StepBudget:
    """The token budget of each step from an online StepCost: the decode rows queued plus the most
    prefill rows (at the first queued prefill's prefix) whose predicted step time fits the step's
    target, within [floor, cap]. The target is `target_s`, or with `target_s` None (auto) `ratio` x
    a plain step's time: the median of the last PLAIN_WINDOW steps that ran no prefill row (observed,
    not predicted: a model fitted to slices of one size cannot tell its fixed cost from its rows'),
    before 3 of them the predicted time of the queued decodes alone (one row when none is queued).
    So a step beside a prompt costs at most `ratio` plain steps, whatever the device, and since each
    step then gives the prompt about (ratio - 1) / ratio of its time, the prompt's prefill takes about
    ratio / (ratio - 1) its time alone (1.5x at ratio 3). Example: t = 0.05 + 0.001 * rows (c = 0),
    target 0.2 s, one decode row queued -> 150 rows (1 decode + 149 prompt rows); auto, ratio 3:
    target 3 x 0.051 = 0.153 s -> 103 rows."""

    cost: StepCost
    target_s: float | None
    floor: int
    cap: int
    ratio: float = AUTO_RATIO
    _plain: deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW), repr=False)  # seconds

    def __post_init__(self) -> None:
        if self.target_s is not None and not self.target_s > 0:
            raise InvalidRequest(f"target_s must be > 0 (or None: auto); got {self.target_s}")
        if not self.ratio > 1:
            raise InvalidRequest(f"ratio must be > 1; got {self.ratio}")
        if not 1 <= self.floor <= self.cap:
            raise InvalidRequest(f"need 1 <= floor <= cap; got floor {self.floor}, cap {self.cap}")

    def target(self, queued: Sequence[Queued]) -> float:
        """This step's target time (seconds)."""
        if self.target_s is not None:
            return self.target_s
        if len(self._plain) >= 3:
            return self.ratio * float(np.median(self._plain))
        d_rows, d_pairs = shape([q for q in queued if not q.prefill])
        return self.ratio * self.cost.predict(max(d_rows, 1), d_pairs)

    def rows(self, queued: Sequence[Queued]) -> int:
        """This step's budget over the calls queued (decodes counted whole, the prefill's rows
        sized to fit)."""
        decodes = [q for q in queued if not q.prefill]
        d_rows, d_pairs = shape(decodes)
        prefix = next((q.prefix for q in queued if q.prefill), 0)
        target = self.target(queued)

        def fits(r: int) -> bool:
            return self.cost.predict(d_rows + r, d_pairs + attended(r, prefix)) <= target

        lo, hi = 0, max(self.cap - d_rows, 0)  # the most prompt rows r with fits(r), by bisection
        if not fits(0):
            hi = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return min(max(d_rows + lo, self.floor), self.cap)

    def observe(self, ran: Sequence[Queued], seconds: float) -> None:
        """The step that ran (its calls, a slice with its own rows and prefix) and its wall time."""
        rows, pairs = shape(ran)
        self.cost.observe(rows, pairs, seconds)
        if ran and not any(q.prefill for q in ran) and seconds >= 0:
            self._plain.append(seconds)
