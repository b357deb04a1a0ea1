"""The overlap decision: draft the next tree ahead (and how far to guess), or not.

A tree drafted ahead runs while the current tree is verified. It saves the next round's draft time
when the guess hits (services/spec/ahead.py) and costs wall time only where it does not overlap:
the part of its run that lands on the round's critical path (the drafter shares a core with the
verifier, or the drafter pool is busy). Per round, for each guess depth j:

    gain(j) = P(hit at j) * draft_s  -  contention * ahead_s(j)
    ahead_s(j) = draft_s + j * step_s          (the j guessed rows are j extra one-row head steps)
    P(hit at j) = P(the committed tokens are the top path's first j tokens + the bonus) (learned per j)
                  * P(the bonus is on the ahead tree)                                    (learned)

and the policy drafts ahead at the j of the largest gain, if that gain is positive; else not at all.

Learning:
  * the prefix hit-rate per depth (ahead.prefix_hits) is learned from EVERY tree round (the top path is known whether or
    not a tree was drafted ahead: `observe_verdict`), so a policy that turned overlap off keeps
    learning and turns it back on when guesses start to hit;
  * the in-tree rate from the rounds that drafted ahead and whose prefix matched (`observe_ahead`);
  * contention from measured wall time (`observe_cost`): the seconds the round waited for the ahead
    draft after the verifier answered, plus the verify slowdown against rounds without overlap, as a
    fraction of the ahead draft's own time; `busy` (a drafter pool's load, 0..1) raises it.
    Both sides stay measured (`measured` sequences, i.e. greedy ones that report seconds): the first
    tree round runs without an ahead draft (the verify baseline: a policy that drafted ahead from the
    start never saw how much its drafts slow the verify), and every `explore_every`-th choice is the
    other one once (an ahead draft where the policy says no, unless the drafter is busy; none where
    it says yes). Count-based, so a seed still replays.
Estimates are Beta-mean counts with a prior and an exponential forgetting factor, so a sequence
whose text changes character adapts. It does not time anything itself: the engine passes seconds in,
and tests pass a synthetic cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RunAhead:
    """Drafting ahead inside a run of tree rounds at the verifier (VerifyRunRequest.ahead): in every
    round of the run the guess is the tree's top path's first `depth` tokens, the path cut at
    `max_guess` (the drafter's tree depth + 2)."""
    depth: int
    max_guess: int
    branches: int = 1  # likely bonuses per attach point (services/spec/ahead_tree.py)
    sort_paths: bool = False  # the sequence samples


@dataclass
class AheadPolicy:
    max_depth: int = 8  # the deepest guess considered (tokens past the root; the top path bounds it)
    contention: float = 0.25  # prior: the fraction of an ahead draft's time on the critical path
    prior_hit: float = 0.5  # prior prefix hit-rate per depth (weight `prior_weight` rounds)
    prior_in_tree: float = 0.7  # prior P(the bonus is on the ahead tree | prefix hit)
    prior_weight: float = 2.0
    decay: float = 0.97  # forgetting per observation
    enabled: bool = True  # False: never draft ahead (the --no-overlap switch)
    learn_cost: bool = True  # False: keep `contention` as given (tests; a known deployment)
    branches: int = 1  # likely bonuses per attach point with a fresh-sized subtree (ahead_tree.py; 0: one tree)
    explore_every: int = 16  # learn_cost: every this many measured choices, the other choice once (0: never)
    _choices: int = 0  # measured choices so far
    _hits: list[float] = field(default_factory=list)  # [max_depth] discounted hits per depth
    _trials: list[float] = field(default_factory=list)  # [max_depth] discounted trials
    _in_tree: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [hits, trials]
    _verify_alone: float | None = None  # EWMA verify seconds of rounds without an ahead draft

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1; got {self.max_depth}")
        self._hits = [0.0] * self.max_depth
        self._trials = [0.0] * self.max_depth

    def hit_rate(self, depth: int) -> float:
        """P(hit) for a guess of `depth` tokens: prefix rate x in-tree rate."""
        w = self.prior_weight
        hits, trials = self._in_tree
        return self._prefix(depth) * (hits + w * self.prior_in_tree) / (trials + w)

    def _prefix(self, depth: int) -> float:
        """P(the committed tokens are the top path's first `depth` tokens + the bonus)."""
        w = self.prior_weight
        return (self._hits[depth - 1] + w * self.prior_hit) / (self._trials[depth - 1] + w)

    def choose(self, draft_s: float, step_s: float, path_len: int, busy: float = 0.0,
               chained: bool = False, measured: bool = False, sharing: int = 1) -> int | None:
        """The guess depth to draft ahead at, or None (do not draft ahead). draft_s: the predicted
        seconds of the next tree's draft; step_s: one one-row head step; path_len: tokens on the
        tree's top path (a guess cannot be longer); busy: the drafter's load (0 idle .. 1 saturated).
        chained: the ahead tree also holds the top path past the guess with bonuses at each of its
        nodes (services/spec/ahead_tree.py), so a guess of j hits at any accept length >= j:
        P(hit at j) = min(1, sum of the prefix rates at j..path_len) x in-tree, and the ahead draft
        costs one more level and a one-row step per chain token.
        measured: the caller reports this round's seconds (observe_cost / observe_alone), so the
        choice explores (module doc); sampling sequences pass False (nominal seconds, no exploring).
        sharing: the caller's sequences on the same drafter (n): their ahead drafts run there one at a
        time, not batched as their drafts are, so a learning policy takes contention >= (n - 1) / n
        (measured on the CPU: at 4 and 16 sequences drafting ahead lost 15-20% where the measured
        contention did not see it; docs/distributed.md). A fixed policy (`learn_cost` False) ignores it."""
        if not self.enabled or path_len < 1 or draft_s <= 0:
            return None
        floor = (sharing - 1) / sharing if self.learn_cost and sharing > 1 else 0.0
        contention = max(self.contention, min(max(busy, 0.0), 1.0), floor)
        best, best_gain = 1, float("-inf")  # the best depth, paying or not
        top = min(self.max_depth, path_len)
        for j in range(1, top + 1):
            if chained:
                in_tree = self.hit_rate(1) / self._prefix(1)
                p_hit = min(1.0, sum(self._prefix(d) for d in range(j, top + 1))) * in_tree
                cost = draft_s + (path_len + 1) * step_s  # guess + chain rows, one level more
            else:
                p_hit, cost = self.hit_rate(j), draft_s + j * step_s
            gain = p_hit * draft_s - contention * cost
            if gain > best_gain:
                best, best_gain = j, gain
        pays = best_gain > 0
        if measured and self.learn_cost:
            self._choices += 1
            if pays and self._verify_alone is None:
                return None  # the verify baseline first
            if self.explore_every and self._choices % self.explore_every == 0 and (pays or max(busy, floor) < 0.5):
                pays = not pays  # the other choice once: both costs stay measured
        return best if pays else None

    @property
    def needs_baseline(self) -> bool:
        """A measured policy has not yet seen a round's verify without an ahead draft (`observe_alone`):
        until then `choose` says no (module doc), and that round should verify alone, as one call."""
        return self.enabled and self.learn_cost and self._verify_alone is None

    def observe_verdict(self, prefix_hits: list[bool]) -> None:
        """prefix_hits[j-1]: did the top path's first j tokens prefix the committed tokens
        (services/spec/ahead.prefix_hits)? Depths past the path count as misses."""
        for j in range(self.max_depth):
            self._hits[j] = self._hits[j] * self.decay + (1.0 if j < len(prefix_hits) and prefix_hits[j] else 0.0)
            self._trials[j] = self._trials[j] * self.decay + 1.0

    def observe_ahead(self, in_tree: bool) -> None:
        """A round whose ahead draft's prefix matched: was the rest of the verdict in the ahead tree?"""
        hits, trials = self._in_tree
        self._in_tree = [hits * self.decay + float(in_tree), trials * self.decay + 1.0]

    def observe_cost(self, ahead_s: float, wait_s: float, verify_s: float) -> None:
        """A round with an ahead draft of `ahead_s` seconds: it waited `wait_s` for it after the
        verifier answered, and the verify took `verify_s` (against the rounds without one)."""
        if ahead_s <= 0 or not self.learn_cost:
            return
        slowdown = max(0.0, verify_s - self._verify_alone) if self._verify_alone is not None else 0.0
        frac = min(1.0, (wait_s + slowdown) / ahead_s)
        self.contention = 0.8 * self.contention + 0.2 * frac

    def observe_alone(self, verify_s: float) -> None:
        """A tree round without an ahead draft: the verify baseline for `observe_cost`."""
        v = self._verify_alone
        self._verify_alone = verify_s if v is None else 0.8 * v + 0.2 * verify_s
