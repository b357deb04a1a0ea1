"""Acceptance statistics: what the budget knows about how often drafts are accepted, as running
estimates per draft depth and sibling rank, and the expected accepted drafts of a tree shape.

Vocabulary:
  * a_d   P(the top-ranked draft child at depth d is accepted | its parent was accepted).
  * c_r   P(the rank-r child (r >= 2) is accepted | its parent was, ranks < r were not).
  * s_d   the same as a_d for the retrieved chain (services/spec/sam.py).

Expected accepted drafts of a shape: EAGLE-2's beam and rerank replayed on estimated acceptance
probabilities instead of draft scores (a node's probability = its parent's x the hit probability of
its rank at its depth); the kept nodes' probabilities add up to the expected number accepted. A
chain adds sum_j prod_{d<=j} s_d (alternatives at the root are nearly disjoint, so the sums add).

    stats = prior_stats(report)                         # from the head's report.json, or a default
    observe(stats, tree, accepted_nodes, chain_nodes)   # per-depth update after a verified round
    observe_realized(stats, plan, accept_length)        # how much of the predicted gain came true

Pure: no I/O (the head's report is read by services/engine/calibration.py `load_report`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.spec.tree import DraftTree

if TYPE_CHECKING:
    from services.spec.budget import RoundPlan

MAX_LEVELS = 12  # deepest draft level the statistics track
MAX_RANK = 8  # sibling ranks tracked
CONSERVATIVE_A = 0.2  # a_d without a head report (the shipped head's measured rate, issue 9)
PRIOR_C = (0.2, 0.12, 0.08, 0.06, 0.05, 0.04, 0.03)  # c_2 .. c_8
PRIOR_S = 0.5  # s_d: a retrieved continuation of an exact match
DEEPER_DECAY = 0.9  # prior a_{d+1} = a_d * decay: deeper draft steps read draft features
REALIZED_MIN, REALIZED_MAX = 0.2, 1.5  # bounds of AcceptanceStats.realized


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

    def copy(self) -> AcceptanceStats:
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


def observe_realized(stats: AcceptanceStats, plan: RoundPlan, accept_length: int) -> None:
    """A round planned as `plan` (a head draft and no retrieved chain, with the model's uncorrected
    head gain `plan.head_gain` > 0) committed `accept_length` tokens (bonus included): the realized share
    of the predicted gain feeds `stats.realized` (clamped to [REALIZED_MIN, REALIZED_MAX]).
    WARNING: mutates `stats`."""
    if plan.tree is None or plan.chain or plan.head_gain <= 1e-6:
        return
    ratio = (accept_length - 1) / plan.head_gain
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


def beam_levels(depth: Sequence[float], rank: Sequence[float], top_k: int, levels: int) -> Iterator[list[float]]:
    """EAGLE-2's beam replayed on acceptance probabilities: for each of `levels` draft levels, the
    acceptance probabilities of its top_k x (frontier size) nodes, the frontier being the previous
    level's top_k likeliest nodes. A node's probability = its parent's x the hit probability of
    its rank at its depth (a_d for rank 1, (1 - a_d) prod_{r'<r} (1 - c_r') c_r for rank r).
    Example: top_k 1, a = [0.5, 0.5], levels 2 -> [0.5], [0.25]."""
    hit = [1.0] + [rank[min(r - 1, len(rank) - 1)] for r in range(1, top_k)]  # c_r by rank
    frontier = [1.0]
    for lv in range(levels):
        a = depth[min(lv, len(depth) - 1)]
        kids = []
        for p in frontier:
            miss = 1.0 - a
            kids.append(p * a)
            for r in range(1, top_k):
                kids.append(p * miss * hit[r])
                miss *= 1.0 - hit[r]
        yield kids
        frontier = sorted(kids, reverse=True)[:top_k]


def expected_accept(depth: Sequence[float], rank: Sequence[float], top_k: int, levels: int,
                    nodes: Sequence[int]) -> list[float]:
    """Expected accepted draft tokens of EAGLE-2 trees with `top_k` and `levels` (= depth + 1)
    draft levels, for each kept-node count in `nodes` (draft nodes, root excluded): the sum of the
    likeliest `n` node probabilities of `beam_levels` (EAGLE-2's rerank).
    Example: a chain (top_k 1) with a = [0.5, 0.5]: levels 2, nodes [1, 2] -> [0.5, 0.75]."""
    ranked = sorted((p for kids in beam_levels(depth, rank, top_k, levels) for p in kids), reverse=True)
    prefix = list(itertools.accumulate(ranked, initial=0.0))
    return [prefix[min(n, len(ranked))] for n in nodes]


def chain_accept(chain: Sequence[float], length: int) -> float:
    """Expected accepted tokens of a chain: sum_j prod_{d<=j} s_d."""
    total, run = 0.0, 1.0
    for d in range(length):
        run *= chain[min(d, len(chain) - 1)]
        total += run
    return total
