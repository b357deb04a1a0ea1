"""The round loop: prefill, then draft -> verify -> commit until a stop condition.

    prefill  the verifier runs the prompt and samples the first token (the first root)
    draft    the drafter extends its KV with the newly committed rows and grows a tree
    verify   the verifier checks the tree in one forward, accepts a path, draws the bonus
    commit   the accepted tokens and the bonus are emitted; stop rules truncate

`Engine` talks to a `Drafter` and a `Verifier` through their methods only, so the coordinator can
drive gRPC clients with the same loop. With no drafter and no retrieval it runs plain
autoregressive decoding through the same target code: the baseline. It does not tokenize or format
prompts.

Each round's shape comes from the `Budget` (services/spec/budget.py): an EAGLE tree of the chosen
top_k / depth / size, a retrieved chain (services/spec/sam.py; the engine holds the sequence's
suffix index, so over gRPC the coordinator does), both merged, or nothing. A round that drafts
nothing verifies the root alone (= one plain decode step that also returns the root's feature):
the committed rows the drafter has not seen wait in `pending` and extend its KV with the next draft.

Detaching: while the budget keeps choosing plain steps, the drafter is left alone. Those rounds are
Decode calls with `keep_features` (the cheapest target step; the verifier keeps each row's features),
with no draft call and no features sent anywhere. The round before the budget's next probe, or before
a tree the load made worth drafting again, is a root-only Verify, whose answer carries every kept
row's features: the next draft catches the drafter's KV up in one call, as after the prefill. The
target computes every token either way, so this is lossless; and since it follows the sequence's own
plans (a seeded sequence's plans do not depend on the load), a seed replays the same tokens.
The budget changes the tree, never the acceptance rule: output stays the target's. A budget with a
load board (continuous batching) sizes each sequence's tree for the whole batch: the sequences
sharing the verifier's forwards post their plans there, keyed by sequence id.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from services.engine.drafter import Drafter
from services.engine.verifier import Verifier
from services.errors import InvalidRequest
from services.spec.acceptance import AcceptanceStats, observe, observe_realized
from services.spec.budget import Budget, RoundPlan
from services.spec.cost import CostCurve, CostModel
from services.spec.sam import SuffixIndex
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams, merge_chain, root_tree

_seq_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class RoundStats:
    index: int  # 0 = prefill
    accept_length: int  # tokens this target forward produced (accepted drafts + bonus); 1 for prefill
    tree_size: int  # nodes verified, root included (0 for prefill / plain decode)
    tree_depth: int  # deepest node verified
    draft_s: float  # time growing the tree that this round verified
    verify_s: float  # time in the verifier (target forward + acceptance + KV compaction)
    chain: int = 0  # retrieved chain tokens in the tree (shared with EAGLE nodes or not)
    predicted_tokens: float = 0.0  # the budget's prediction for this round: committed tokens
    predicted_s: float = 0.0  # and round seconds (0 = no prediction: plain decoding)
    detached: bool = False  # a plain step with the drafter detached (no draft, no features sent)
    chain_accepted: int = 0  # of the retrieved chain tokens, accepted this round
    eagle_nodes: int = 0  # draft-head nodes in the tree, root excluded (0 = the head drafted nothing)


@dataclass(frozen=True, slots=True)
class StepOutput:
    tokens: list[int]  # newly committed tokens, stop-truncated
    stats: RoundStats
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished


def check_stop(new: list[int], produced: int, max_new_tokens: int, stop_ids: frozenset[int]
               ) -> tuple[list[int], str | None]:
    """Truncate `new` at the first stop token (kept) or at the token budget; tokens after a stop are
    dropped. Example: new [5, 9, 2, 7], stop {2}, produced 10, max 100 -> ([5, 9, 2], "stop")."""
    for i, tok in enumerate(new):
        if produced + i + 1 > max_new_tokens:
            return new[:i], "length"
        if tok in stop_ids:
            return new[: i + 1], "stop"
    if produced + len(new) >= max_new_tokens:
        return new, "length"
    return new, None


def fixed_budget(drafter: Drafter | None, retrieval: bool = False) -> Budget:
    """The drafter's own shape every round (no cost model): what an Engine built without a budget
    runs. Costs are nominal (one unit per verified node), so its predictions mean nothing."""
    tree = drafter.tree if drafter is not None else TreeParams(1, 0, 2)
    return Budget(CostModel(CostCurve((1, 2), (1.0, 2.0))), largest=tree, fixed=tree,
                  eagle=drafter is not None, chain_limit=8 if retrieval else 0)


@dataclass
class _Draft:
    """The tree in flight and what `observe` needs about it."""
    tree: DraftTree
    plan: RoundPlan
    chain_nodes: list[int]
    eagle_size: int  # nodes 0..eagle_size-1 came from the draft head (or the root alone)
    draft_s: float
    detached: bool = False  # a plain step through Decode(keep_features): no tree is verified


class Engine:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, max_context: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] = (), budget: Budget | None = None,
                 retrieval: bool = False) -> None:
        """`budget` None: the drafter's fixed shape; `retrieval`: a suffix index proposes chains."""
        self.verifier = verifier
        self.drafter = drafter
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.retrieval = retrieval
        budget = budget or fixed_budget(drafter, retrieval)
        # what the budget may use is what this engine has: a head, retrieval
        self.budget = replace(budget, eagle=budget.eagle and drafter is not None,
                              chain_limit=budget.chain_limit if retrieval else 0)
        # the latest `realized` of any greedy sequence (of this engine, or with a load board of every
        # engine sharing the verifier): where the next greedy sequence starts (it would otherwise
        # relearn it from the prior, drafting at a loss meanwhile); sampling sequences start from
        # the prior, so that a seed replays the same trees whatever ran before
        self.realized = self.budget.prior.realized
        largest = self.budget.fixed or self.budget.largest
        if self.budget.eagle and not drafter.tree.covers(largest):
            raise InvalidRequest(f"the budget's largest tree (top_k={largest.top_k}, depth={largest.depth}, "
                                 f"tokens={largest.total_tokens}) does not fit the drafter's KV "
                                 f"(top_k={drafter.tree.top_k}, depth={drafter.tree.depth}, "
                                 f"tokens={drafter.tree.total_tokens})")

    def plain(self) -> "Engine":
        """The same verifier with no draft at all: aerie's plain decoding, the baseline of a speed-up."""
        return Engine(self.verifier, None, self.max_context, self.vocab_size, self.eos_token_ids)

    @property
    def speculates(self) -> bool:
        return self.drafter is not None or self.retrieval

    def validate(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise InvalidRequest("prompt is empty: give at least one token")
        for i, tok in enumerate(req.prompt_ids):
            if not 0 <= tok < self.vocab_size:
                raise InvalidRequest(
                    f"prompt token id {tok} at position {i} is outside the vocabulary [0, {self.vocab_size})")
        for tok in req.stop_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise InvalidRequest(f"stop token id {tok} is outside the vocabulary [0, {self.vocab_size})")
        if req.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1; got {req.max_new_tokens}")
        total = len(req.prompt_ids) + req.max_new_tokens
        if total > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"exceeds the model context of {self.max_context} tokens")

    def stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        eos = () if req.ignore_eos else self.eos_token_ids
        return frozenset(req.stop_token_ids) | frozenset(eos)

    def generate(self, req: GenerationRequest, seq_id: str | None = None) -> Iterator[StepOutput]:
        """Yield one StepOutput after prefill and one per round; the last has a finish_reason."""
        self.validate(req)
        seq_id = seq_id or f"local-{next(_seq_counter)}"
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long)
        # KV rows: every committed token plus one tree (or one decode token) in flight
        tree_nodes = self.budget.max_nodes() if self.speculates else 1
        capacity = len(req.prompt_ids) + req.max_new_tokens + tree_nodes
        stop_ids = self.stop_ids(req)
        if self.budget.load is not None:
            self.budget.load.join(seq_id)
        try:
            yield from self._run(req, seq_id, prompt, capacity, stop_ids)
        finally:
            if self.budget.load is not None:
                self.budget.load.leave(seq_id)
            self.verifier.release(seq_id)
            if self.drafter:
                self.drafter.release(seq_id)

    def _run(self, req, seq_id, prompt, capacity, stop_ids) -> Iterator[StepOutput]:
        t0 = time.perf_counter()
        pre = self.verifier.prefill(seq_id, prompt, req.sampling, capacity)
        verify_s = time.perf_counter() - t0
        produced = 0
        new, reason = check_stop([pre.first_token], produced, req.max_new_tokens, stop_ids)
        seq = _SequenceState(self.budget.new_stats(), SuffixIndex() if self.retrieval else None,
                             sort_paths=not req.sampling.greedy)
        if req.sampling.greedy:
            board = self.budget.load
            seq.stats.realized = board.realized if board is not None and board.realized is not None else self.realized
        draft = None
        if reason is None and self.speculates:
            if self.drafter:
                self.drafter.start(seq_id, capacity, sampling=not req.sampling.greedy)
                seq.pending_tokens.append(torch.cat([prompt[1:], torch.tensor([pre.first_token])]))
                seq.pending_features.append(pre.features)
            if seq.index is not None:
                seq.index.extend(req.prompt_ids)
                seq.index.extend([pre.first_token])
            draft = self._draft(seq_id, seq, pre.first_token)
        produced += len(new)
        yield StepOutput(new, RoundStats(0, 1, 0, 0, 0.0, verify_s), reason)
        last = pre.first_token
        for index in itertools.count(1):
            if reason is not None:
                return
            t1 = time.perf_counter()
            if draft is None:  # plain decoding: one token per target forward
                fresh = [self.verifier.decode(seq_id, last, index)]
                stats = RoundStats(index, 1, 0, 0, 0.0, time.perf_counter() - t1)
            elif draft.detached:  # the budget chose a plain step: the features stay on the verifier
                fresh = [self.verifier.decode(seq_id, last, index, keep_features=True)]
                stats = RoundStats(index, 1, 0, 0, draft.draft_s, time.perf_counter() - t1,
                                   predicted_tokens=draft.plan.tokens, predicted_s=draft.plan.seconds, detached=True)
                self.budget.observe_verify(draft.plan, stats.verify_s)  # (measured latency: the load board)
            else:
                tree = draft.tree
                res = self.verifier.verify(seq_id, tree, index)
                verify_s = time.perf_counter() - t1
                self.budget.observe_verify(draft.plan, verify_s)
                fresh = res.acceptance.new_tokens
                accepted = res.acceptance.nodes.tolist()
                observe(seq.stats, tree, accepted, draft.chain_nodes, draft.eagle_size)
                observe_realized(seq.stats, draft.plan, len(fresh))
                if not seq.sort_paths:
                    self.realized = seq.stats.realized
                    if self.budget.load is not None:
                        self.budget.load.realized = seq.stats.realized
                stats = RoundStats(index, len(fresh), tree.size if draft.plan.drafts else 0,
                                   tree.max_depth, draft.draft_s, verify_s, len(draft.chain_nodes),
                                   draft.plan.tokens, draft.plan.seconds,
                                   chain_accepted=len(set(accepted) & set(draft.chain_nodes)),
                                   eagle_nodes=draft.eagle_size - 1)
            new, reason = check_stop(fresh, produced, req.max_new_tokens, stop_ids)
            produced += len(new)
            last = fresh[-1]
            if reason is None and draft is not None:
                if self.drafter:
                    seq.pending_tokens.append(torch.tensor(fresh))
                    if not draft.detached:  # (a detached round's feature comes with the next Verify)
                        seq.pending_features.append(res.features)
                if seq.index is not None:
                    seq.index.extend(fresh)
                draft = self._draft(seq_id, seq, last)
            yield StepOutput(new, stats, reason)

    def _draft(self, seq_id: str, seq: "_SequenceState", root: int) -> _Draft:
        """Plan the next round and build its tree: EAGLE (extending the draft KV with every pending
        row), the retrieved chain, both, or the root alone."""
        t0 = time.perf_counter()
        chain = seq.index.propose(self.budget.chain_limit) if seq.index is not None else []
        # alone, the rows waiting for the draft KV are paid whenever the head next drafts (a sunk
        # cost): the decision uses a steady round's extension (root + about one accepted token); in a
        # batch they are charged (Budget.plan's pending_rows)
        # with a load board, greedy sequences size their trees for the batch; sampling sequences keep
        # the batch-1 choice so that a seed replays the same tokens whatever the load
        plan = self.budget.plan(seq.stats, len(chain), commit_rows=2.0, key=seq_id, adapt=not seq.sort_paths,
                                pending_rows=sum(int(t.shape[0]) for t in seq.pending_tokens))
        detached = seq.detached
        seq.detached = (self.budget.detach and self.drafter is not None and plan.tree is None and plan.chain == 0
                        and not self.budget.probes_next(seq.stats))
        if seq.detached:  # a plain step that leaves the drafter alone (see the module doc)
            return _Draft(root_tree(root), plan, [], 1, time.perf_counter() - t0, detached=True)
        if plan.tree is not None and detached:
            # the rows of the detached rounds have no features here yet: this round verifies the
            # root alone, whose answer brings them; the tree waits for the next round's plan
            plan = RoundPlan(None, 0, 1.0, 0.0)
        if plan.tree is not None:
            tokens = torch.cat(seq.pending_tokens)
            features = torch.cat(seq.pending_features)
            seq.pending_tokens.clear()
            seq.pending_features.clear()
            t_call = time.perf_counter()
            tree = self.drafter.draft(seq_id, tokens, features, plan.tree)
            self.budget.observe_draft(plan.tree, int(tokens.shape[0]), time.perf_counter() - t_call)
        else:
            tree = root_tree(root)
        eagle_size = tree.size
        tree, chain_nodes = merge_chain(tree, chain[: plan.chain], seq.sort_paths)
        return _Draft(tree, plan, chain_nodes, eagle_size, time.perf_counter() - t0)


@dataclass
class _SequenceState:
    stats: AcceptanceStats  # this sequence's acceptance estimates (start: the budget's prior)
    index: SuffixIndex | None  # retrieval: prompt + committed tokens
    sort_paths: bool  # sampling: paths in lexicographic order
    pending_tokens: list[torch.Tensor] = field(default_factory=list)  # committed, not yet in the draft KV
    pending_features: list[torch.Tensor] = field(default_factory=list)
    detached: bool = False  # the last planned round leaves its features on the verifier
