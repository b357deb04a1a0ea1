"""The draft budget: each round's tree shape chosen from a measured cost model and running
acceptance statistics, to maximise expected committed tokens per second.

    costs = load_or_calibrate(target, head, key)       # t_verify(rows), t_draft(rows) on this device
    budget = Budget(costs, prior_stats(head_dir), largest=TreeParams(4, 7, 24))
    stats = budget.new_stats()                          # one per sequence (an EMA, starts at the prior)
    plan = budget.plan(stats, chain=len(retrieved))     # -> RoundPlan(tree | None, chain, predicted)
    ... draft plan.tree, merge plan.chain retrieved tokens, verify ...
    observe(stats, tree, accepted_nodes, chain_nodes)  # per-depth acceptance update
    observe_realized(stats, plan, accepted_tokens)      # how much of the predicted gain came true

Vocabulary:
  * cost model   t_verify(rows): one target forward over `rows` tree nodes (tree attention) on this
                 device; t_draft(rows): one draft-head step over `rows` rows (decoder layer +
                 projection + log-softmax); t_head(rows): the head layer alone (extending the draft
                 KV with committed rows). Piecewise linear between measured row counts.
  * a_d          P(the top-ranked draft child at depth d is accepted | its parent was accepted).
  * c_r          P(the rank-r child (r >= 2) is accepted | its parent was, ranks < r were not).
  * s_d          the same as a_d for the retrieved chain (services/spec/sam.py).
  * shape        TreeParams(top_k, depth, total_tokens, stop_logprob), or none (verify the root only =
                 a plain decode step), plus the number of retrieved chain tokens joined to it.

Expected accepted tokens of a shape: EAGLE-2's beam and rerank replayed on estimated acceptance
probabilities instead of draft scores (a node's probability = its parent's x the hit probability of
its rank at its depth); the kept nodes' probabilities add up to the expected accept length. A chain
adds sum_j prod_{d<=j} s_d (alternatives at the root are nearly disjoint, so the sums add).
Round time = t_head(committed rows) + t_draft(1) + depth * t_draft(top_k) + t_verify(nodes).

Dynamic depth (DDD/SVIP): a node of acceptance probability p pays if p / dt >= the round's rate,
dt being the cost of one more level (a draft step and a verified node). Draft probabilities are
turned into acceptance probabilities with the ratio a_1 / (mean top-1 draft probability at depth 1),
giving `TreeParams.stop_logprob`, below which the tree builder stops expanding and drops nodes.

Pure: no services, no I/O except the cost cache (json under $AERIE_CACHE_DIR/costs).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from services.errors import InvalidRequest
from services.spec.tree import DraftTree, TreeParams

MAX_LEVELS = 12  # deepest draft level the statistics track
MAX_RANK = 8  # sibling ranks tracked
CONSERVATIVE_A = 0.2  # a_d without a head report (the shipped head's measured rate, issue 9)
PRIOR_C = (0.2, 0.12, 0.08, 0.06, 0.05, 0.04, 0.03)  # c_2 .. c_8
PRIOR_S = 0.5  # s_d: a retrieved continuation of an exact match
DEEPER_DECAY = 0.9  # prior a_{d+1} = a_d * decay: deeper draft steps read draft features
CHAIN_LIMIT = 16  # longest retrieved chain the budget joins
PROBE_CHAIN = 4  # retrieved tokens a probe verifies at most (deeper depths: when a plan chooses them)
REALIZED_MIN, REALIZED_MAX = 0.2, 1.5  # bounds of AcceptanceStats.realized
COST_VERSION = 2


# ---- cost model ----------------------------------------------------------------------------------


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
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])):
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
    def from_dict(d: dict) -> "CostCurve":
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
    def from_dict(d: dict) -> "CostModel":
        return CostModel(CostCurve.from_dict(d["verify"]), CostCurve.from_dict(d["head"]),
                         CostCurve.from_dict(d["logits"]))


# ---- acceptance statistics -------------------------------------------------------------------------


@dataclass(slots=True)
class AcceptanceStats:
    """Running estimates (exponential moving averages with weight `alpha` on each observation)."""

    depth: list[float]  # [MAX_LEVELS] a_d, d = 1.. (index d - 1)
    rank: list[float]  # [MAX_RANK - 1] c_r, r = 2.. (index r - 2)
    chain: list[float]  # [MAX_LEVELS] s_d for the retrieved chain
    confidence: float = 0.5  # mean draft probability of the top child at depth 1
    alpha: float = 0.15
    realized: float = 1.0  # accepted head tokens per predicted one, on rounds that drafted (EMA;
    #                        the model's expected gain assumes the best nodes by its own probabilities,
    #                        the head drafts by its scores and dynamic depth prunes: measured 0.4-0.7
    #                        on the shipped head). Scales every predicted head gain (Budget._choose).
    idle_rounds: int = 0  # consecutive rounds that drafted nothing (for probing)
    probe_gap: int = 0  # idle rounds before the next probe (0 = the budget's probe_every; backs off)
    memo: tuple | None = None  # (statistics, load, output) of the last choice (Budget._plan): a round
    #                            whose statistics and load did not change is not planned again

    def copy(self) -> "AcceptanceStats":
        return AcceptanceStats(list(self.depth), list(self.rank), list(self.chain), self.confidence,
                               self.alpha, self.realized, 0, 0)

    def calibration(self) -> float:
        """Acceptance probability per unit of draft probability (a_1 / mean top-1 draft probability)."""
        return min(5.0, max(0.2, self.depth[0] / max(self.confidence, 1e-3)))


def ema(old: float, x: float, alpha: float) -> float:
    """One EMA step: old + alpha * (x - old). ema(0.2, 1, 0.15) = 0.32."""
    return old + alpha * (x - old)


def prior_stats(report: dict | None = None, alpha: float = 0.15) -> AcceptanceStats:
    """From a head's report.json (`top1_agreement`: held-out top-1 agreement with the target, taken as
    a_1, deeper levels decayed), else the conservative default."""
    a1 = CONSERVATIVE_A
    if report and isinstance(report.get("top1_agreement"), (int, float)):
        a1 = min(0.95, max(0.01, float(report["top1_agreement"])))
    return AcceptanceStats(depth=[a1 * DEEPER_DECAY ** d for d in range(MAX_LEVELS)],
                           rank=list(PRIOR_C[: MAX_RANK - 1]), chain=[PRIOR_S] * MAX_LEVELS,
                           confidence=max(a1, 0.05), alpha=alpha)


def load_report(head_dir: str | Path | None) -> dict | None:
    if head_dir is None:
        return None
    path = Path(head_dir) / "report.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def observe_realized(stats: AcceptanceStats, plan: "RoundPlan", accepted_tokens: int) -> None:
    """A round planned as `plan` (a head draft and no retrieved chain, with the model's uncorrected
    head gain `plan.head_gain` > 0) committed `accepted_tokens` (bonus included): the realized share
    of the predicted gain feeds `stats.realized` (clamped to [REALIZED_MIN, REALIZED_MAX]).
    WARNING: mutates `stats`."""
    if plan.tree is None or plan.chain or plan.head_gain <= 1e-6:
        return
    ratio = (accepted_tokens - 1) / plan.head_gain
    stats.realized = min(REALIZED_MAX, max(REALIZED_MIN, ema(stats.realized, ratio, stats.alpha)))


def observe(stats: AcceptanceStats, tree: DraftTree, accepted: Sequence[int],
            chain_nodes: Sequence[int] = (), eagle_size: int | None = None) -> None:
    """Update `stats` from one verified round. `accepted` = the root and the accepted node indices
    (Acceptance.nodes); `chain_nodes` = the retrieved chain's node indices, depth 1 first;
    `eagle_size` = nodes 0..eagle_size-1 came from the draft head (the chain's own nodes follow;
    None = all). A chain node the head also proposed counts for both. WARNING: mutates `stats`."""
    parents = tree.parents.tolist()
    scores = tree.scores.tolist()
    eagle_size = len(parents) if eagle_size is None else eagle_size
    chain = list(chain_nodes)
    children: dict[int, list[int]] = {}
    for i in range(1, eagle_size):
        children.setdefault(parents[i], []).append(i)
    a = stats.alpha
    for d in range(1, MAX_LEVELS + 1):
        if d > len(accepted):
            break
        parent = accepted[d - 1]
        hit = accepted[d] if d < len(accepted) else -1
        kids = sorted(children.get(parent, []), key=lambda i: -scores[i])
        if kids:
            stats.depth[d - 1] = ema(stats.depth[d - 1], float(hit == kids[0]), a)
            if d == 1:
                stats.confidence = ema(stats.confidence, math.exp(scores[kids[0]]), a)
            for r in range(1, min(len(kids), MAX_RANK)):
                if hit in kids[:r]:
                    break
                stats.rank[r - 1] = ema(stats.rank[r - 1], float(hit == kids[r]), a)
        if d <= len(chain) and (d == 1 or chain[d - 2] == parent):
            stats.chain[d - 1] = ema(stats.chain[d - 1], float(hit == chain[d - 1]), a)


# ---- the load: other sequences sharing the target forward ----------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """What the other sequences batched into the same target forwards asked for in their latest
    round (their plans): the batch this sequence's rows join."""

    sequences: int = 0
    rows: float = 0.0  # rows they verify per forward (1 for a plain decode step)
    tokens: float = 0.0  # tokens they are predicted to commit per forward
    draft_s: float = 0.0  # their draft seconds per round
    draft_extra: float = 0.0  # measured: a draft's latency beyond the cost model's compute, seconds
    verify_extra: float = 0.0  # measured: a round's verify latency beyond the modelled forward, seconds


def same_load(a: Load, b: Load, tolerance: float = 0.1) -> bool:
    """Whether two loads are the same batch for planning: the same sequences, rows and tokens (to
    0.001) and seconds within `tolerance` relative (or 0.5 ms): the measured extras move by less
    than their noise from round to round, and a steady batch must not be re-planned for that."""
    def near(x: float, y: float) -> bool:
        return abs(x - y) <= max(5e-4, tolerance * max(abs(x), abs(y)))

    return (a.sequences == b.sequences and abs(a.rows - b.rows) < 1e-3 and abs(a.tokens - b.tokens) < 1e-3
            and near(a.draft_s, b.draft_s) and near(a.draft_extra, b.draft_extra)
            and near(a.verify_extra, b.verify_extra))


class LoadBoard:
    """The sequences that share one verifier's forwards (continuous batching), each with its latest
    plan, and two latencies measured on the rounds they run (EMAs, weight `alpha`): how much longer a
    draft takes than the cost model's compute for it (the draft call's round trip, the drafter's
    queue, catching up the draft KV) and how much longer a verify call takes than the modelled
    forward (the verify call's round trip, the batch's gathering, a batch forward's per-sequence
    attention). The calibrated curves are one sequence's forward in process; these extras are what
    the services add on this machine, and the chooser charges them (Budget._choose).
    Thread-safe; one per verifier (in process) or per verifier address (coordinator)."""

    def __init__(self, alpha: float = 0.1) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, tuple[float, float, float]] = {}  # key -> (rows, tokens, draft_s)
        self.alpha = alpha
        self._draft_extra: float | None = None  # None until measured
        self._verify_extra: float | None = None
        self.realized: float | None = None  # the latest AcceptanceStats.realized of a greedy sequence
        #                                     here (None until one drafted): where new ones start

    def others(self, key: str) -> Load:
        with self._lock:
            rest = [v for k, v in self._plans.items() if k != key]
            de, ve = self._draft_extra or 0.0, self._verify_extra or 0.0
        return Load(len(rest), sum(r for r, _, _ in rest), sum(t for _, t, _ in rest), sum(d for _, _, d in rest),
                    de, ve)

    def observe_draft(self, excess_s: float) -> None:
        """One draft call's measured seconds minus the cost model's compute for it (>= 0 kept)."""
        self._observe("_draft_extra", excess_s)

    def observe_verify(self, excess_s: float) -> None:
        """One verify (or decode) call's measured seconds minus the modelled batch forward. The draft
        extra is forgotten slowly meanwhile (by alpha / 16 per call): measured under another load
        (a burst of catch-up drafts), it must not rule out drafting, and probing, for good."""
        self._observe("_verify_extra", excess_s)
        with self._lock:
            if self._draft_extra:
                self._draft_extra *= 1.0 - self.alpha / 16

    def _observe(self, name: str, x: float) -> None:
        if not math.isfinite(x):
            return
        x = max(0.0, x)
        with self._lock:
            old = getattr(self, name)
            setattr(self, name, x if old is None else ema(old, x, self.alpha))

    def post(self, key: str, rows: float, tokens: float, draft_s: float) -> None:
        with self._lock:
            self._plans[key] = (rows, tokens, draft_s)

    def join(self, key: str) -> None:
        """A sequence starts (before its prefill): until it plans, the others count it as a plain
        step, so sequences that start together see each other from their first plan on."""
        with self._lock:
            self._plans.setdefault(key, (1.0, 1.0, 0.0))

    def leave(self, key: str) -> None:
        with self._lock:
            self._plans.pop(key, None)

    def rows(self) -> dict[str, float]:
        """key -> the rows of that sequence's latest plan (1 = a plain decode step)."""
        with self._lock:
            return {k: v[0] for k, v in self._plans.items()}


def batch_verify(costs: "CostModel", others: float, rows: float) -> float:
    """One target forward over the others' rows plus `rows` of this sequence. Beyond its first row,
    each row costs at least the curve's top slope (the compute-bound cost of a row): a curve measured
    on a busy machine can be flat over a range of rows, and such a flat range must not make a
    batch's extra tree rows look free."""
    first = costs.t_verify(others + 1)
    return max(costs.t_verify(others + rows), first + costs.verify.top_slope() * (rows - 1))


# ---- the chooser ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundPlan:
    tree: TreeParams | None  # the EAGLE shape to draft; None = no head draft this round
    chain: int  # retrieved tokens to join (0 = none)
    tokens: float  # predicted committed tokens (accepted + bonus)
    seconds: float  # predicted round time
    verify_s: float = 0.0  # of which the modelled target forward (the batch's), measured extras excluded
    draft_s: float = 0.0  # of which this sequence's own draft (the model's compute + the measured extra)
    head_gain: float = 0.0  # the model's expected accepted head tokens, before the `realized` correction

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def drafts(self) -> bool:
        return self.tree is not None or self.chain > 0


def expected_accept(depth: Sequence[float], rank: Sequence[float], top_k: int, levels: int,
                    nodes: Sequence[int]) -> list[float]:
    """Expected accepted draft tokens of EAGLE-2 trees with `top_k` and `levels` (= depth + 1)
    draft levels, for each kept-node count in `nodes` (draft nodes, root excluded).
    Example: a chain (top_k 1) with a = [0.5, 0.5]: levels 2, nodes [1, 2] -> [0.5, 0.75]."""
    hit = [1.0] + [rank[min(r - 1, len(rank) - 1)] for r in range(1, top_k)]  # c_r by rank
    all_probs: list[float] = []
    frontier = [1.0]
    for lv in range(levels):
        a = depth[min(lv, len(depth) - 1)]
        kids = []
        for p in frontier:
            miss = 1.0 - a
            for r in range(top_k):
                if r == 0:
                    kids.append(p * a)
                else:
                    kids.append(p * miss * hit[r])
                    miss *= 1.0 - hit[r]
        all_probs += kids
        frontier = sorted(kids, reverse=True)[:top_k]
    all_probs.sort(reverse=True)
    prefix = [0.0]
    for p in all_probs:
        prefix.append(prefix[-1] + p)
    return [prefix[min(n, len(all_probs))] for n in nodes]


def chain_accept(chain: Sequence[float], length: int) -> float:
    """Expected accepted tokens of a chain: sum_j prod_{d<=j} s_d."""
    total, run = 0.0, 1.0
    for d in range(length):
        run *= chain[min(d, len(chain) - 1)]
        total += run
    return total


NODE_COUNTS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60, 64)


@dataclass(frozen=True, slots=True)
class Budget:
    """Chooses every round's shape. `largest` bounds it (the drafter's KV is sized for it); `fixed`
    forces one shape every round (explicit --tree-* flags; no plain rounds, no dynamic depth)."""

    costs: CostModel
    prior: AcceptanceStats = field(default_factory=prior_stats)
    largest: TreeParams = TreeParams(4, 7, 24)
    fixed: TreeParams | None = None
    eagle: bool = True  # a draft head is available
    chain_limit: int = CHAIN_LIMIT  # retrieved tokens joined at most (0 = no retrieval)
    probe_every: int = 16  # after this many rounds without drafting, draft one token to re-measure
    stop_depth: bool = True  # dynamic depth (stop_logprob)
    detach: bool = True  # plain steps leave the drafter alone until the next probe (Engine: detaching)
    load: LoadBoard | None = field(default=None, compare=False)  # batching: the sequences sharing forwards
    load_margin: float = 0.05  # with other sequences in the batch, a draft must beat plain by this share
    probe_accept: float | None = 0.8  # a probe runs only if drafting would pay at this acceptance
    #                                   (per depth); None = probe every gap unconditionally
    probe_backoff: int = 8  # probe gap doubles after a probe that changes nothing, up to this x probe_every

    def new_stats(self) -> AcceptanceStats:
        return self.prior.copy()

    def probes_next(self, stats: AcceptanceStats) -> bool:
        """Whether the next plan drafts to re-measure acceptance if it would otherwise be plain (the
        engine attaches the drafter one round ahead of it). Always True for a fixed shape."""
        return self.fixed is not None or stats.idle_rounds + 1 >= (stats.probe_gap or self.probe_every)

    def max_nodes(self) -> int:
        """The most nodes a round can verify (KV reservation on the verifier)."""
        eagle = (self.fixed or self.largest).total_tokens if self.eagle else 1
        return eagle + self.chain_limit

    def plan(self, stats: AcceptanceStats, chain: int = 0, commit_rows: float = 2.0, key: str | None = None,
             adapt: bool = True, pending_rows: int = 0) -> RoundPlan:
        """The shape with the highest predicted committed tokens per second, given `chain` retrieved
        tokens available. With a load board and the sequence's `key`: the shape that maximises the
        whole batch's predicted committed tokens per second, the other sequences' latest plans
        fixed (their rows join this one's in the target forward), and this plan is posted for them.
        `adapt` False: the batch-1 choice, still posted (a seeded sampling sequence keeps shapes that
        do not depend on the load, so its seed replays identically; greedy output is exact anyway).
        `pending_rows`: committed rows the draft KV has not seen (the prompt before the first draft,
        the rounds since the last): alone they are a sunk cost (the head pays them whenever it next
        drafts, so a steady round's `commit_rows` decides), but with others in the batch the draft
        that catches them up delays every sequence's forward, and a sequence that stays plain never
        pays them: there the plan is charged for them.
        WARNING: counts idle rounds in `stats` (probing)."""
        load = self.load.others(key) if self.load is not None and key is not None and adapt else Load()
        if load.sequences:
            commit_rows = max(commit_rows, float(pending_rows))
        best = self._plan(stats, chain, commit_rows, load)
        if self.load is not None and key is not None:
            rows = (best.tree.total_tokens if best.tree is not None else 1) + best.chain
            self.load.post(key, rows, best.tokens, best.draft_s)
        return best

    def observe_draft(self, params: TreeParams, commit_rows: int, seconds: float) -> None:
        """A draft call of `params` that extended the draft KV with `commit_rows` rows took `seconds`
        (measured by the caller, round trip included): its excess over the model feeds the board."""
        if self.load is not None and self.fixed is None:
            self.load.observe_draft(seconds - self.costs.draft_seconds(params, commit_rows))

    def observe_verify(self, plan: RoundPlan, seconds: float) -> None:
        """The verify (or decode) call of a round planned as `plan` took `seconds`."""
        if self.load is not None and self.fixed is None and plan.verify_s > 0:
            self.load.observe_verify(seconds - plan.verify_s)

    def _plan(self, stats: AcceptanceStats, chain: int, commit_rows: float, load: Load) -> RoundPlan:
        """`_choose`, then probing: after `probe_gap` rounds without drafting, draft one token (and
        the whole retrieved chain) to re-measure acceptance, but under load only if drafting would
        pay at the optimistic acceptance `probe_accept` (decided one round ahead, so the
        engine attaches the drafter only for a probe that runs). A probe after which the budget
        stays plain doubles the gap (up to probe_backoff x probe_every); a drafting round resets it."""
        key = (tuple(stats.depth), tuple(stats.rank), tuple(stats.chain), stats.confidence, stats.realized, chain,
               commit_rows)
        memo = stats.memo
        if memo is not None and memo[0] == key and same_load(memo[1], load):
            best, smallest, tv, chain_gain = memo[2]  # the load it was planned for stays the reference
        else:
            best, smallest, tv, chain_gain = choice = self._choose(stats, chain, commit_rows, load)
            stats.memo = (key, load, choice)
        if self.fixed is not None:
            return best  # the same shape every round: no probing, no dynamic depth
        gap = stats.probe_gap or self.probe_every
        backed_off = min(2 * gap, self.probe_every * max(1, self.probe_backoff))  # after a probe (run or skipped)
        if best.drafts:
            stats.idle_rounds = 0
            stats.probe_gap = 0
        else:
            stats.idle_rounds += 1
            if stats.idle_rounds >= gap:  # re-measure acceptance now and then
                stats.idle_rounds = 0
                stats.probe_gap = backed_off
                # one draft token, and the first PROBE_CHAIN retrieved tokens: a probe of the whole
                # chain (16 rows, ~1.7 plain steps here) cost more than its answers were worth on
                # long prompts whose matches rarely continue; deeper chain depths are re-measured
                # whenever the shallower ones make a plan choose them
                probe = min(chain, PROBE_CHAIN)
                if smallest is not None:
                    best = replace(smallest, chain=probe, tokens=smallest.tokens + chain_gain[probe],
                                   seconds=smallest.seconds + tv[2 + probe] - tv[2],
                                   verify_s=smallest.verify_s + tv[2 + probe] - tv[2])
                elif probe:
                    best = RoundPlan(None, probe, 1.0 + chain_gain[probe], tv[1 + probe],
                                     best.verify_s + tv[1 + probe] - tv[1])
            elif stats.idle_rounds + 1 >= gap and not self._worth_probing(stats, chain, commit_rows, load):
                stats.idle_rounds = 0  # the probe could not change the choice: skip it
                stats.probe_gap = backed_off
        if best.tree is not None and self.stop_depth:
            best = replace(best, tree=replace(best.tree, stop_logprob=self.stop_logprob(stats, best, load)))
        return best

    def _worth_probing(self, stats: AcceptanceStats, chain: int, commit_rows: float, load: Load) -> bool:
        """Whether the choice would draft if acceptance were `probe_accept` at every depth (where
        it is not already higher): else a probe costs the batch a draft and can change nothing.
        Alone (no other sequence in the forward) a probe costs only this sequence one draft per gap,
        so it always runs."""
        if self.probe_accept is None or not load.sequences:
            return True
        hopeful = stats.copy()
        hopeful.depth = [max(a, self.probe_accept) for a in hopeful.depth]
        hopeful.chain = [max(s, self.probe_accept) for s in hopeful.chain]
        return self._choose(hopeful, chain, commit_rows, load)[0].drafts

    def _choose(self, stats: AcceptanceStats, chain: int, commit_rows: float, load: Load
                ) -> tuple[RoundPlan, RoundPlan | None, tuple[float, ...], list[float]]:
        """-> (the best plan, the smallest EAGLE plan (a probe), tv, chain gains). Pure.

        RoundPlan.seconds is the batch's round on its critical path: the others' drafts, this
        sequence's draft (the model's compute plus the board's measured draft extra), and one target
        forward over the others' rows plus this sequence's (plus the measured verify extra); rates
        count the others' tokens too, so a draft that delays the batch's forward is charged for
        every sequence's tokens it delays. With others in the batch, a drafting shape must beat the
        best plain (or retrieval-only) rate by `load_margin` (the model's error is larger than the
        gains at stake there)."""
        chain = min(chain, self.chain_limit)
        c = self.costs
        extra_draft, extra_verify = load.draft_extra, load.verify_extra

        def rate(p: RoundPlan) -> float:
            return (load.tokens + p.tokens) / p.seconds if p.seconds > 0 else 0.0

        n_max = (self.fixed or self.largest).total_tokens + chain + 1
        # fv[n]: the batch's modelled target forward with this sequence's n rows
        fv = _batch_verify_table(c, load.rows, n_max) if load.sequences else _verify_table(c, n_max)
        # tv[n]: the round without this sequence's draft: others' drafts, the forward, the measured extra
        tv = (0.0,) + tuple(f + load.draft_s + extra_verify for f in fv[1:])
        chain_gain = [chain_accept(stats.chain, n) for n in range(chain + 1)]
        if self.fixed is not None:
            e = expected_accept(stats.depth, stats.rank, self.fixed.top_k, self.fixed.depth + 1,
                                [self.fixed.total_tokens - 1])[0] if self.eagle else 0.0
            e += chain_gain[chain]
            n = (self.fixed.total_tokens if self.eagle else 1) + chain
            own = c.draft_seconds(self.fixed, commit_rows) + extra_draft if self.eagle else 0.0
            return RoundPlan(self.fixed if self.eagle else None, chain, 1 + e, own + tv[n], fv[n], own), None, tv, chain_gain
        best = RoundPlan(None, 0, 1.0, tv[1], fv[1])
        for n in range(1, chain + 1):  # retrieval alone
            cand = RoundPlan(None, n, 1.0 + chain_gain[n], tv[1 + n], fv[1 + n])
            best = max(best, cand, key=rate)
        smallest: RoundPlan | None = None
        if self.eagle:
            base = c.head(commit_rows) + c.logits(1) + extra_draft
            lim = self.largest
            extras = (0, chain) if chain else (0,)
            best_rate, best_key = rate(best) * (1.0 + (self.load_margin if load.sequences else 0.0)), None
            others = load.tokens
            # the one-token draft (k=1, depth 0: one node, accepted with a_1): a probe's shape
            real = stats.realized
            smallest = RoundPlan(TreeParams(1, 0, 2), 0, 1.0 + real * stats.depth[0], base + tv[2], fv[2], base,
                                 stats.depth[0])
            search = _eagle_bound(stats, c, lim, base, tv, chain_gain, extras, others) > best_rate
            for k in range(1, min(lim.top_k, MAX_RANK) + 1 if search else 1):
                step = c.t_draft(k)
                hit = [1.0] + [stats.rank[min(r - 1, len(stats.rank) - 1)] for r in range(1, k)]
                frontier, probs = [1.0], []
                for d in range(0, min(lim.depth, MAX_LEVELS - 1) + 1):
                    if d * k > lim.draft_rows:
                        break
                    a = stats.depth[min(d, len(stats.depth) - 1)]
                    kids = []
                    for p in frontier:  # expected_accept's beam, one level at a time
                        miss = 1.0 - a
                        kids.append(p * a)
                        for r in range(1, k):
                            kids.append(p * miss * hit[r])
                            miss *= 1.0 - hit[r]
                    probs += kids
                    frontier = sorted(kids, reverse=True)[:k]
                    if k == 1:
                        counts = (d + 2,)
                    else:
                        top = min(k + d * k * k, lim.total_tokens - 1)
                        counts = tuple(n for n in NODE_COUNTS if k <= n - 1 <= top) or (k + 1,)
                    ranked = sorted(probs, reverse=True)
                    prefix = list(itertools.accumulate(ranked, initial=0.0))
                    t_draft = base + d * step
                    for n in counts:
                        g = prefix[min(n - 1, len(ranked))]
                        for extra in extras:
                            r8 = (others + 1.0 + real * g + chain_gain[extra]) / (t_draft + tv[n + extra])
                            if r8 > best_rate:
                                best_rate = r8
                                best_key = (k, d, n, extra, 1.0 + real * g + chain_gain[extra],
                                            t_draft + tv[n + extra], fv[n + extra], t_draft, g)
            if best_key is not None:
                k, d, n, extra, tokens, seconds, forward, own, g = best_key
                best = RoundPlan(TreeParams(k, d, n), extra, tokens, seconds, forward, own, g)
        return best, smallest, tv, chain_gain

    def stop_logprob(self, stats: AcceptanceStats, plan: RoundPlan, load: Load = Load()) -> float:
        """Cumulative draft log-probability below which a node does not pay for itself (at the
        batch's rate and the batch forward's marginal cost of a row)."""
        p = plan.tree
        assert p is not None
        c = self.costs
        rows = load.rows + p.total_tokens
        dt = c.t_draft(p.top_k) / p.top_k + c.t_verify(rows + 1) - c.t_verify(rows)
        if load.sequences:
            dt = max(dt, c.t_draft(p.top_k) / p.top_k + c.verify.top_slope())
        rate = (load.tokens + plan.tokens) / plan.seconds if plan.seconds > 0 else 0.0
        p_min = rate * max(dt, 0.0)
        q_min = p_min / stats.calibration()
        if q_min <= 0:
            return float("-inf")
        return math.log(min(q_min, 1.0))


# ---- calibration on the device -------------------------------------------------------------------


def _eagle_bound(stats: AcceptanceStats, c: CostModel, lim: TreeParams, base: float, tv: Sequence[float],
                 chain_gain: Sequence[float], extras: Sequence[int], others: float) -> float:
    """An upper bound of the rate of every EAGLE shape `Budget._choose` searches, in O(depth x
    expected tokens): when it cannot beat the best plain rate (the usual case under load), the
    search is skipped.

    A shape (k, depth d, n nodes) commits 1 + realized x g tokens, g the sum of its n - 1 most likely nodes'
    acceptance probabilities, each at most the likeliest depth-1 node's (a child's probability is
    its parent's times a factor <= 1), so g <= (n - 1) p_max; those nodes lie in levels 0..d of the full tree with
    the largest top_k K, whose level l sums to prod_{j<=l} c_j, c_j = 1 - (1 - a_j) prod_r (1 - c_r)
    (some child accepted), so g <= G_d = sum_{l<=d} prod_{j<=l} c_j. Its round takes at least
    base + d * min_k t_draft(k) + min_{m >= n + extra} tv[m] (a measured tv need not grow with rows),
    which grows with n: past n = G_d / p_max + 1 only the time grows, so larger n need no check."""
    real = stats.realized
    top = min(lim.top_k, MAX_RANK)
    hits = [stats.rank[min(r - 1, len(stats.rank) - 1)] for r in range(1, top)]
    none_hit = math.prod(1.0 - h for h in hits)
    a0 = stats.depth[0]
    largest = max([a0] + [(1.0 - a0) * math.prod(1.0 - h for h in hits[:i]) * hits[i] for i in range(len(hits))])
    step = min(c.t_draft(k) for k in range(1, top + 1))
    floor = list(tv)  # floor[m] = min(tv[m:])
    for m in range(len(floor) - 2, -1, -1):
        floor[m] = min(floor[m], floor[m + 1])
    reach, levels, bound = 1.0, 0.0, 0.0
    for d in range(min(lim.depth, MAX_LEVELS - 1) + 1):
        a = stats.depth[min(d, len(stats.depth) - 1)]
        reach *= 1.0 - (1.0 - a) * none_hit
        levels += reach
        for e in extras:
            for n in range(2, min(len(floor) - 1 - e, math.ceil(levels / max(largest, 1e-9)) + 1) + 1):
                g = real * min(levels, (n - 1.0) * largest)
                bound = max(bound, (others + 1.0 + g + chain_gain[e]) / (base + d * step + floor[n + e]))
    return bound * (1.0 + 1e-9)  # (rounding: never skip a shape the search would pick)


@functools.lru_cache(maxsize=16)
def _verify_table(costs: CostModel, n: int) -> tuple[float, ...]:
    """(0, t_verify(1), ..., t_verify(n))."""
    return (0.0,) + tuple(costs.t_verify(r) for r in range(1, n + 1))


@functools.lru_cache(maxsize=256)
def _batch_verify_table(costs: CostModel, others: float, n: int) -> tuple[float, ...]:
    """(0, batch_verify(others, 1), ..., batch_verify(others, n)): the others' rows take few values."""
    return (0.0,) + tuple(batch_verify(costs, others, r) for r in range(1, n + 1))


VERIFY_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
HEAD_ROWS = (1, 2, 4, 8, 16)


def time_calls(fn: Callable[[int], None], rows: Sequence[int], repeats: int = 5, what: str = "timed calls"
               ) -> CostCurve:
    """The fastest of `repeats` timed calls of `fn(rows)` for each row count (one untimed warm-up
    call each): on a shared machine the minimum is the least disturbed, so the ratios between row
    counts (what the chooser compares) stay stable; made non-decreasing in rows. The repeats are
    interleaved (pass 1 times every row count, then pass 2, ...): a burst of load from another
    process then slows one pass of every row count rather than all repeats of one (which used to
    leave a step in the curve, e.g. 2 rows at 1.8x one row, that made every draft look too dear)."""
    from services.progress import counter

    tick = counter(what, len(rows) * (repeats + 1))  # on a terminal: "what: i/n"
    for r in rows:
        fn(r)
        tick()
    ts: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            t0 = time.perf_counter()
            fn(r)
            ts[r].append(time.perf_counter() - t0)
            tick()
    out = [min(ts[r]) for r in rows]
    return CostCurve(tuple(rows), tuple(itertools.accumulate(out, max)))


@torch.no_grad()
def calibrate_target(target, rows: Sequence[int] = VERIFY_ROWS, prefix: int = 128, repeats: int = 5
                     ) -> CostCurve:
    """t_verify: the target's tree-attention forward over `rows` chain nodes after `prefix` tokens."""
    device = target.device
    vocab = target.config.vocab_size
    cache = target.new_cache(prefix + max(rows))
    g = torch.Generator().manual_seed(0)
    target(torch.randint(0, vocab, (prefix,), generator=g).to(device), cache, logits_for="last")

    def run(r: int) -> None:
        ids = torch.randint(0, vocab, (r,), generator=g).to(device)
        mask = torch.ones(r, r, dtype=torch.bool, device=device).tril()
        target(ids, cache, positions=prefix + torch.arange(r, device=device), tree_mask=mask)
        cache.truncate(prefix)

    return time_calls(run, rows, repeats, "target forwards")


@torch.no_grad()
def calibrate_head(head, rows: Sequence[int] = HEAD_ROWS, prefix: int = 128, repeats: int = 5
                   ) -> tuple[CostCurve, CostCurve]:
    """(t_head, t_logits): the head's layer over `rows` rows after `prefix` rows, and its
    projection + log-softmax over `rows` rows."""
    device = head.device
    f, v = head.config.feature_size, head.config.vocab_size
    cache = head.new_cache(prefix + max(rows))
    g = torch.Generator().manual_seed(0)
    head(torch.randn(prefix, f, generator=g).to(device, head.dtype),
         torch.randint(0, v, (prefix,), generator=g).to(device), cache)
    outs = {}

    def layer(r: int) -> None:
        outs[r] = head(torch.randn(r, f, generator=g).to(device, head.dtype),
                       torch.randint(0, v, (r,), generator=g).to(device), cache)
        cache.truncate(prefix)

    def project(r: int) -> None:
        head.log_probs(outs[r])

    return (time_calls(layer, rows, repeats, "draft-head layer calls"),
            time_calls(project, rows, repeats, "draft-head projections"))


def device_name(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cpus)"


def cost_key(role: str, model_id: str, device: torch.device | str, dtype: torch.dtype) -> str:
    return (f"v{COST_VERSION}|{role}|{model_id}|{device_name(device)}|{dtype}|"
            f"threads={torch.get_num_threads()}")


def cache_dir() -> Path:
    """$AERIE_COST_DIR, else $AERIE_CACHE_DIR/costs (default ~/.cache/aerie/costs)."""
    if os.environ.get("AERIE_COST_DIR"):
        return Path(os.environ["AERIE_COST_DIR"]).expanduser()
    return Path(os.environ.get("AERIE_CACHE_DIR") or "~/.cache/aerie").expanduser() / "costs"


def _read_cached(path: Path, key: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data["costs"] if data.get("key") == key else None
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str):
    """Hold an exclusive flock on `lock_path`: one process measures a calibration at a time (`aerie
    up` starts a verifier and a drafter that both want the target's costs; measured side by side on
    the same cores, each would disturb the other's timings and both would pay for it)."""
    import fcntl

    from services.progress import note

    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            note(f"waiting for another process measuring {what}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(key: str, measure: Callable[[], dict], recalibrate: bool = False, what: str = "costs") -> dict:
    """The calibration stored for `key`, or `measure()` stored now (announced on stderr as `what`,
    services/progress.py). `recalibrate` (or AERIE_RECALIBRATE=1) measures again. Processes that
    want the same key measure one at a time; one that waited reads the other's result."""
    path = cache_dir() / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    recalibrate = recalibrate or os.environ.get("AERIE_RECALIBRATE", "") not in ("", "0")
    if not recalibrate and (hit := _read_cached(path, key)) is not None:
        return hit
    from services.progress import phase

    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.with_suffix(".lock"), what):
        if not recalibrate and (hit := _read_cached(path, key)) is not None:  # measured while this one waited
            return hit
        with phase(f"measuring {what} once on this device for the draft budget (cached in {path.parent}; "
                   f"--recalibrate measures again)"):
            costs = measure()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "costs": costs}, indent=1))
        tmp.replace(path)
    return costs


def target_costs(target, model_id: str, recalibrate: bool = False) -> CostCurve:
    # the weight layout changes the rows -> time curve (docs/design.md "Cheaper rounds")
    key = cost_key("verify", model_id, target.device, target.dtype) + f"|layout={getattr(target, 'layout', '')}"
    what = (f"the target's verify cost: its forward over {VERIFY_ROWS[0]}..{VERIFY_ROWS[-1]} tree rows after a "
            f"128-token prefix, fastest of 5 per row count")
    return CostCurve.from_dict(cached(key, lambda: calibrate_target(target).to_dict(), recalibrate, what))


def head_costs(head, model_id: str, recalibrate: bool = False) -> tuple[CostCurve, CostCurve]:
    key = cost_key("draft", model_id, head.device, head.dtype)

    def measure() -> dict:
        layer, proj = calibrate_head(head)
        return {"head": layer.to_dict(), "logits": proj.to_dict()}

    what = (f"the draft head's cost: its layer and its vocabulary projection over {HEAD_ROWS[0]}..{HEAD_ROWS[-1]} "
            f"rows, fastest of 5 per row count")
    d = cached(key, measure, recalibrate, what)
    return CostCurve.from_dict(d["head"]), CostCurve.from_dict(d["logits"])


AUTO_LARGEST = TreeParams(4, 7, 32)  # the largest shape `auto` may pick (sizes the draft KV)


def build_budget(costs: CostModel, report: dict | None, tree: TreeParams | None, eagle: bool,
                 retrieval: bool) -> Budget:
    """`tree` None = auto (the chooser, bounded by AUTO_LARGEST); a TreeParams = that shape every
    round (explicit --tree-* flags). The one constructor the CLI, the bench and the services use."""
    largest = tree or AUTO_LARGEST
    return Budget(costs, prior_stats(report), largest=largest, fixed=tree, eagle=eagle,
                  chain_limit=CHAIN_LIMIT if retrieval else 0)
