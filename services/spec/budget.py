"""The draft budget: each round's tree shape chosen from a measured cost model (services/spec/cost.py)
and running acceptance statistics (services/spec/acceptance.py), to maximise expected committed
tokens per second, the batch's when other sequences share the target forwards
(services/spec/load_board.py).

    costs = CostModel(target_costs(...), *head_costs(...))  # services/engine/calibration.py
    budget = build_budget(costs, report, tree=None, eagle=True, retrieval=True)
    stats = budget.new_stats()                          # one per sequence (an EMA, starts at the prior)
    plan = budget.plan(stats, chain=len(retrieved))     # -> RoundPlan(tree | None, chain, predicted)
    ... draft plan.tree, merge plan.chain retrieved tokens, verify ...
    observe(stats, tree, accepted_nodes, chain_nodes)  # per-depth acceptance update
    observe_realized(stats, plan, accept_length)        # how much of the predicted gain came true

A shape is TreeParams(top_k, depth, size, stop_logprob), or none (verify the root only = a
plain decode step), plus the number of retrieved chain tokens joined to it. Its expected committed
tokens = 1 (the bonus) + the expected accepted drafts (acceptance.expected_accept, scaled by
`AcceptanceStats.realized`) + the chain's (acceptance.chain_accept).
Round time = t_head(committed rows) + t_draft(1) + depth * t_draft(top_k) + t_verify(nodes).

Dynamic depth (DDD/SVIP): a node of acceptance probability p pays if p / dt >= the round's rate,
dt being the cost of one more level (a draft step and a verified node). Draft probabilities are
turned into acceptance probabilities with the ratio a_1 / (mean top-1 draft probability at depth 1),
giving `TreeParams.stop_logprob`, below which the tree builder stops expanding and drops nodes.

Pure: no services, no I/O.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from services.spec.acceptance import (
    MAX_LEVELS,
    MAX_RANK,
    AcceptanceStats,
    beam_levels,
    chain_accept,
    expected_accept,
    prior_stats,
)
from services.spec.cost import CostCurve, CostModel, batch_verify_table, verify_table
from services.spec.load_board import Load, LoadBoard, same_load
from services.spec.tree import TreeParams

CHAIN_LIMIT = 16  # longest retrieved chain the budget joins
PROBE_CHAIN = 4  # retrieved tokens a probe verifies at most (deeper depths: when a plan chooses them)
NODE_COUNTS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60, 64)  # tree sizes the search tries
AUTO_LARGEST = TreeParams(4, 7, 32)  # the largest shape `auto` may pick (sizes the draft KV)
NOMINAL_COSTS = CostModel(CostCurve((1, 2), (1.0, 2.0)))  # no calibration: one unit per verified row


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


class Choice(NamedTuple):
    """One search's answer (`Budget._choose`), memoised per sequence (AcceptanceStats.memo)."""

    best: RoundPlan
    smallest: RoundPlan | None  # the one-token EAGLE plan (a probe's shape); None without a head
    tv: tuple[float, ...]  # [max rows + 1] the round without this sequence's draft, by its rows
    chain_gain: list[float]  # [chain + 1] expected accepted retrieved tokens, by chain length


class _Times(NamedTuple):
    """Round-time tables of one search, indexed by this sequence's verified rows n (0 unused)."""

    fv: tuple[float, ...]  # [max rows + 1] the batch's modelled target forward with n rows of ours
    tv: tuple[float, ...]  # [max rows + 1] fv + the others' drafts + the measured verify extra
    chain_gain: list[float]  # [chain + 1] expected accepted retrieved tokens, by chain length


@dataclass(frozen=True, slots=True)
class _Shape:
    """An EAGLE shape the tree search found (the search's running best)."""

    top_k: int
    depth: int  # expansion steps (TreeParams.depth)
    size: int  # nodes kept, root included
    chain: int  # retrieved tokens joined
    gain: float  # the model's expected accepted head tokens, before the `realized` correction
    draft_s: float  # this sequence's draft seconds (compute + the measured extra)


@functools.cache
def _node_counts(top_k: int, depth: int, size: int) -> tuple[int, ...]:
    """The tree sizes (root included) the search tries for `top_k` and `depth`: a chain keeps all of
    its depth + 2 nodes; a wider tree the NODE_COUNTS between top_k + 1 and its candidates + 1
    (at most `size`). Example: (1, 3, 32) -> (5,); (2, 1, 32) -> (3, 4, 5, 6, 7)."""
    if top_k == 1:
        return (depth + 2,)
    top = min(top_k + depth * top_k * top_k, size - 1)
    return tuple(n for n in NODE_COUNTS if top_k <= n - 1 <= top) or (top_k + 1,)


def _batch_rate(plan: RoundPlan, load: Load) -> float:
    """The batch's predicted committed tokens per second with this plan."""
    return (load.tokens + plan.tokens) / plan.seconds if plan.seconds > 0 else 0.0


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

    def detached_rounds(self, stats: AcceptanceStats) -> int:
        """Called for a detached round (planned plain, probes_next False): how many rounds from it on,
        this one included, stay detached while the plans stay plain, i.e. before the round that
        probes_next attaches the drafter for. Each plain plan adds one idle round, and round j (0 =
        this one) stays detached while idle_rounds + j + 1 < gap. Example: gap 16, idle_rounds 3 ->
        12 (rounds 0..11; the plan of round 12 reaches idle 15 and attaches the drafter)."""
        return max(1, (stats.probe_gap or self.probe_every) - stats.idle_rounds - 1)

    def max_tree_size(self) -> int:
        """The largest tree (nodes, root included) a round can verify (KV reservation on the verifier)."""
        eagle = (self.fixed or self.largest).size if self.eagle else 1
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
            rows = (best.tree.size if best.tree is not None else 1) + best.chain
            self.load.post(key, rows, best.tokens, best.draft_s)
        return best

    def observe_draft(self, params: TreeParams, commit_rows: int, seconds: float) -> None:
        """A draft call of `params` that extended the draft KV with `commit_rows` rows took `seconds`
        (measured by the caller, round trip included): its excess over the model feeds the board."""
        if self.load is not None and self.fixed is None:
            self.load.observe_draft(seconds - self.costs.draft_seconds(params, commit_rows))

    def observe_verify(self, plan: RoundPlan, seconds: float) -> None:
        """The verify (or decode) call of a round planned as `plan` took `seconds` (a plain plan's:
        the board's plain extra, LoadBoard)."""
        if self.load is not None and self.fixed is None and plan.verify_s > 0:
            if plan.tree is None and not plan.chain:
                self.load.observe_plain(seconds - plan.verify_s)
            else:
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

    def _choose(self, stats: AcceptanceStats, chain: int, commit_rows: float, load: Load) -> Choice:
        """-> (the best plan, the smallest EAGLE plan (a probe), tv, chain gains). Pure.

        RoundPlan.seconds is the batch's round on its critical path: the others' drafts, this
        sequence's draft (the model's compute plus the board's measured draft extra), and one target
        forward over the others' rows plus this sequence's (plus the measured verify extra); rates
        count the others' tokens too, so a draft that delays the batch's forward is charged for
        every sequence's tokens it delays. With others in the batch, a drafting shape must beat the
        best plain (or retrieval-only) rate by `load_margin` (the model's error is larger than the
        gains at stake there)."""
        chain = min(chain, self.chain_limit)
        times = self._times(stats, chain, load)
        if self.fixed is not None:
            return Choice(self._fixed_plan(stats, chain, commit_rows, load, times), None, times.tv,
                          times.chain_gain)
        best = self._headless_plan(chain, times, load)
        if not self.eagle:
            return Choice(best, None, times.tv, times.chain_gain)
        base = self.costs.head(commit_rows) + self.costs.logits(1) + load.draft_extra  # a draft before expanding
        # the one-token draft (k=1, depth 0: one node, accepted with a_1): a probe's shape
        smallest = RoundPlan(TreeParams(1, 0, 2), 0, 1.0 + stats.realized * stats.depth[0], base + times.tv[2],
                             times.fv[2], base, stats.depth[0])
        bar = _batch_rate(best, load) * (1.0 + (self.load_margin if load.sequences else 0.0))
        extras = (0, chain) if chain else (0,)
        if _eagle_bound(stats, self.costs, self.largest, base, times.tv, times.chain_gain, extras,
                        load.tokens) > bar:
            shape = self._search_trees(stats, base, extras, times, load.tokens, bar)
            if shape is not None:
                best = self._shape_plan(shape, stats.realized, times)
        return Choice(best, smallest, times.tv, times.chain_gain)

    def _times(self, stats: AcceptanceStats, chain: int, load: Load) -> _Times:
        n_max = (self.fixed or self.largest).size + chain + 1
        c = self.costs
        fv = batch_verify_table(c, load.rows, n_max) if load.sequences else verify_table(c, n_max)
        # a plain step (1 row) is charged the plain rounds' extra once measured, every tree the tree rounds'
        plain = load.verify_extra if load.plain_extra is None else load.plain_extra
        tv = (0.0,) + tuple(f + load.draft_s + (plain if n == 1 else load.verify_extra)
                            for n, f in enumerate(fv[1:], 1))
        return _Times(fv, tv, [chain_accept(stats.chain, n) for n in range(chain + 1)])

    def _fixed_plan(self, stats: AcceptanceStats, chain: int, commit_rows: float, load: Load, t: _Times
                    ) -> RoundPlan:
        """The fixed shape (or, without a head, the plain step) with the whole retrieved chain."""
        fixed = self.fixed
        assert fixed is not None
        e = expected_accept(stats.depth, stats.rank, fixed.top_k, fixed.depth + 1,
                            [fixed.size - 1])[0] if self.eagle else 0.0
        e += t.chain_gain[chain]
        n = (fixed.size if self.eagle else 1) + chain
        own = self.costs.draft_seconds(fixed, commit_rows) + load.draft_extra if self.eagle else 0.0
        return RoundPlan(fixed if self.eagle else None, chain, 1 + e, own + t.tv[n], t.fv[n], own)

    @staticmethod
    def _headless_plan(chain: int, t: _Times, load: Load) -> RoundPlan:
        """The best round without a head draft: a plain step, or the first n retrieved tokens."""
        best = RoundPlan(None, 0, 1.0, t.tv[1], t.fv[1])
        for n in range(1, chain + 1):
            cand = RoundPlan(None, n, 1.0 + t.chain_gain[n], t.tv[1 + n], t.fv[1 + n])
            best = max(best, cand, key=lambda p: _batch_rate(p, load))
        return best

    def _search_trees(self, stats: AcceptanceStats, base: float, extras: Sequence[int], t: _Times,
                      others: float, bar: float) -> _Shape | None:
        """The EAGLE shape (top_k, depth, size, joined chain in `extras`) of the highest batch
        rate above `bar`, or None. For each top_k the beam (acceptance.beam_levels) grows one level
        at a time; a tree of n nodes keeps the n - 1 likeliest nodes so far (EAGLE-2's rerank)."""
        lim, real, tv, gains = self.largest, stats.realized, t.tv, t.chain_gain  # (locals: the inner loop is hot)
        best: _Shape | None = None
        for k in range(1, min(lim.top_k, MAX_RANK) + 1):
            step = self.costs.t_draft(k)
            probs: list[float] = []
            for d, kids in enumerate(beam_levels(stats.depth, stats.rank, k, min(lim.depth, MAX_LEVELS - 1) + 1)):
                if d * k > lim.draft_rows:
                    break
                probs += kids
                prefix = list(itertools.accumulate(sorted(probs, reverse=True), initial=0.0))
                t_draft = base + d * step
                for n in _node_counts(k, d, lim.size):
                    g = prefix[min(n - 1, len(probs))]
                    for extra in extras:
                        rate = (others + 1.0 + real * g + gains[extra]) / (t_draft + tv[n + extra])
                        if rate > bar:
                            bar, best = rate, _Shape(k, d, n, extra, g, t_draft)
        return best

    @staticmethod
    def _shape_plan(s: _Shape, realized: float, t: _Times) -> RoundPlan:
        rows = s.size + s.chain
        return RoundPlan(TreeParams(s.top_k, s.depth, s.size), s.chain,
                         1.0 + realized * s.gain + t.chain_gain[s.chain], s.draft_s + t.tv[rows], t.fv[rows],
                         s.draft_s, s.gain)

    def stop_logprob(self, stats: AcceptanceStats, plan: RoundPlan, load: Load = Load()) -> float:
        """Cumulative draft log-probability below which a node does not pay for itself (at the
        batch's rate and the batch forward's marginal cost of a row)."""
        p = plan.tree
        assert p is not None
        c = self.costs
        rows = load.rows + p.size
        dt = c.t_draft(p.top_k) / p.top_k + c.t_verify(rows + 1) - c.t_verify(rows)
        if load.sequences:
            dt = max(dt, c.t_draft(p.top_k) / p.top_k + c.verify.top_slope())
        rate = (load.tokens + plan.tokens) / plan.seconds if plan.seconds > 0 else 0.0
        p_min = rate * max(dt, 0.0)
        q_min = p_min / stats.calibration()
        if q_min <= 0:
            return float("-inf")
        return math.log(min(q_min, 1.0))



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



def build_budget(costs: CostModel | None, report: dict | None, tree: TreeParams | None, eagle: bool,
                 retrieval: bool, largest: TreeParams = AUTO_LARGEST) -> Budget:
    """The one constructor of a Budget: the CLI, the bench, the coordinator (codec.decode_budget) and
    an Engine given none use it. `costs` None = nominal (one unit per verified row: predictions
    then mean nothing; for a fixed shape); `report` the head's report.json (the prior); `tree` None =
    auto (the chooser, bounded by `largest`, which sizes the draft KV); a TreeParams = that shape
    every round (explicit --tree-* flags)."""
    return Budget(costs or NOMINAL_COSTS, prior_stats(report), largest=tree or largest, fixed=tree, eagle=eagle,
                  chain_limit=CHAIN_LIMIT if retrieval else 0)
