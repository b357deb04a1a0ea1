"""The round loop: prefill, then draft -> verify -> commit until a stop condition.

    prefill  the verifier runs the prompt and samples the first token (the first root)
    draft    the drafter extends its KV with the newly committed rows and grows a tree
    verify   the verifier checks the tree in one forward, accepts a path, draws the bonus
    commit   the accepted tokens and the bonus are emitted; stop rules truncate

`Engine` talks to a drafter and a verifier through their roles only (services/engine/roles.py), so the coordinator can
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

Plain runs (`plain_run` N > 0, a verifier role with `decode_run`: the coordinator's gRPC verifier,
where they hide the round trip, and the local Verifier on a GPU, where each step is queued on the
device before the previous token is read so the device does not wait for the host's per-token work,
services/engine/plain_run.py): a plain round (no drafter) or a detached round that finds no
run open starts one, a DecodeRun of h steps, h = min(N, tokens max_new_tokens still allows, and for
detached rounds the rounds before the budget's next probe: Budget.detached_rounds); the following
rounds take their tokens from it, each still its own round (RoundOutput, RoundStats with
verify_s = the time it waited for its token), committed and streamed as before. The verifier queues
each next step itself, so it never waits for the coordinator between them. The budget still plans
every detached round (its bookkeeping is that of h single rounds); a plan that would draft again
inside a run (only a load change can: h ends before the probe) waits for the run's end. A stop
(EOS, stop ids, max_new_tokens) or a cancel closes the run. With retrieval no runs: its chains
depend on every new token.

Trees on the device (`device_trees`; on where the drafter drafts statically and the verifier runs
the static-shape forward on the same device: in process on a GPU): the drafter re-ranks the
candidates on the device (services/spec/tree_static.py rerank_static) and returns a TreeOnDevice,
whose tokens, depths and mask the verifier's forward reads there, so the verify is queued behind the
draft without the host reading the candidates first; the host tree (`TreeOnDevice.host()`, the same
nodes) is read while the verify runs, for acceptance and the statistics. A round with a retrieved
chain or an ahead draft builds its tree on the host as before.
Verdict drafts (`verdict_drafts`; with device trees, no retrieval and no drafting ahead, for a
greedy sequence without a penalty or logprobs): the verifier calls back once the verify's forward is
queued, and the next draft is queued from the verdict still on the device (next_rows_on_device: the
accepted rows and the bonus; Drafter.draft_from_verdict), behind the verify and before the host reads
anything, in the verified round's own shape; the host then reads the verdict (its copy was queued
before the draft) and, when its rows are the verdict's, commits them to the draft KV
(Drafter.commit) and plans the next round: with a fixed tree the queued tree is the plan's; the
adaptive budget plans from the verdict (its stop moves every round), so its queued candidates are
re-ranked to the plan's size and stop on the device once it is known, or expanded again where the
plan's top_k or depth differ (Drafter.redraft: no second extension), or left unused for a plain
round. A verdict the host reads otherwise drops the queued draft and drafts after it. The device
then runs verify, draft, verify, ... while the host does each round's bookkeeping; `verdict_counts`
counts what became of the queued drafts.

Drafting inside the Verify (a verifier role with `drafts_next(seq_id)`: the coordinator's placement
when the sequence's drafter is its verifier's own process, a verifier started with --draft): a tree
round asks the verifier to draft the next tree from its verdict in the same call, in the round's own
shape (`verify(..., next_draft=params)`), exactly the Draft the engine would send after it (the
accepted tokens and the bonus with their features); the draft KV then holds those rows, and the next
round uses that tree, cut to the budget's plan (trim) or left unused for a plain round. One call a
round instead of a Verify and a Draft; the same trees wherever the plan keeps the round's shape (a
fixed tree: always). Not with retrieval, in a round that drafts ahead, or with rows waiting for the
draft KV (the detached rounds' rows, an ahead hit's): those rounds draft as before. Round 1's tree
likewise comes with the prefill where the role `drafts_first(seq_id)` (the prompt's features then
never reach the engine): round 1 is planned before the prefill (`prefill(..., first_draft=params)`;
a plain plan prefills as before). With an overlap
policy the rounds it declines draft inside the Verify (and run, below); no round of an open run
drafts ahead, and the policy chooses again after the run.

Tree runs (a verifier role with `verify_run` that drafts inside the Verify, `plain_run` N > 1): the
verifier runs up to N tree rounds back to back, each verifying the tree it drafted in the round
before, in the run's first shape, without waiting for the coordinator between them (the VerifyRun
call), as plain runs do for plain rounds; each round is still its own RoundOutput, committed and
streamed as before. The run ends before the rounds that may end the request and after a round with a
stop id; a stop, cancel or broken run closes it (the rounds after it are single Verify calls,
answered from what the run computed where it did). With the adaptive budget the plan may change the
shape while a run goes on: the verifier may have verified the run's next tree already (a run queues
its next round before an answer goes out), so a verdict a run computed (VerifyResult.from_run) holds
that tree as it is for the next round (`held`; the run is closed) and the plan applies from the first
round no run computed (a run never computes a round after a single Verify's: verifier_svc). The
budget's dynamic-depth threshold (`TreeParams.stop_logprob`) moves with every verdict; a plan that
changes only it is the run's shape (`TreeParams.shape`): the run goes on with the threshold of its
first round (its trees are verified as the verifier drafted them), and the plan's threshold applies
from the first round no run computed. (Closing the run at every new threshold closed every run.) How many
rounds a closed run computed depends on timing, so a sampling sequence with the adaptive budget
verifies one round a call (its seed replays the same trees).

Drafting ahead (`ahead`: an AheadPolicy; services/spec/ahead.py and overlap.py): while a tree is
verified, a drafter thread grows the next tree from a guessed verdict (the top path's first j tokens;
the policy picks j, or not to draft ahead at all). If the verdict hits the guess, the next round
verifies the ahead tree rerooted at the real bonus and no draft is waited for; otherwise it is
thrown away and the next tree is drafted as without overlap. The draft KV keeps only committed rows
with target features either way (the guessed rows are dropped), so only the ahead trees themselves
differ from the non-overlapped run: output stays the target's (the verifier checks every token); a
seed replays the same tokens (the guess and the ahead tree never depend on timing: the round always
waits for the ahead draft before it looks at it).
Where the verifier can run tree rounds and draft ahead itself (`runs_ahead`: direct drafts to a drafter
in another process), a round whose policy drafts ahead starts a run that does (RunAhead: the chosen
guess depth, for every round of the run; verifier_svc/ahead_run.py) instead of drafting ahead from
here: with a fixed tree, and with the adaptive budget for greedy sequences (a run left for a new
shape holds its next tree, as above, and its DraftAhead in flight costs nothing: the next Draft says
where its rows go in the draft KV). Its answers say which rows the draft KV has not taken
(`pending_rows`: they replace the pending rows here) and whether the next tree was drafted ahead (a
hit); the policy learns from each of its rounds and chooses again after it. Its baseline round (a
measured policy's first verify without an ahead draft) is one Verify, not a run.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from services.engine.roles import DrafterRole, VerifierRole
from services.errors import InvalidRequest
from services.spec.acceptance import AcceptanceStats, observe, observe_realized
from services.spec.ahead import chain_past, prefix_hits, top_guess, trim, use_ahead
from services.spec.budget import Budget, RoundPlan, build_budget
from services.spec.logprobs import TokenLogprobs
from services.spec.overlap import AheadPolicy, RunAhead
from services.spec.sam import SuffixIndex
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeOnDevice, TreeParams, host_tree, merge_chain, root_tree
from services.spec.verify import next_rows_on_device

if TYPE_CHECKING:
    from services.engine.drafter import VerdictDraft

AHEAD_RUN = 8  # rounds of a run that drafts ahead at the verifier, at most (Engine._tree_run)

log = logging.getLogger(__name__)

_seq_counter = itertools.count()

# Why a sequence finished: a stop token (an EOS too) or, in the coordinator, a stop string; its
# max_new_tokens; a cancel (the coordinator). The same strings reach clients (gRPC, HTTP).
FinishReason = Literal["stop", "length", "cancel"]

# (tree in flight, guess depth the policy chose, tokens produced so far) -> the guess (tokens past the
# root). The default is services/spec/ahead.top_guess; tests inject guesses that always hit or miss.
Guesser = Callable[[DraftTree, int, int], list[int]]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class RoundStats:
    round_index: int  # the round's number: 0 = prefill, then round_base + 1, + 2, ...
    accept_length: int  # m + 1: tokens this round committed (accepted drafts + bonus); 1 for prefill
    tree_size: int  # nodes verified, root included (0 for prefill / plain decode)
    tree_max_depth: int  # the deepest verified node's depth (root 0; DraftTree.max_depth): a full tree
    #                      of TreeParams.depth d (expansion steps, not a node depth) reaches d + 1
    draft_s: float  # time growing the tree that this round verified
    verify_s: float  # time in the verifier (target forward + acceptance + KV compaction)
    chain: int = 0  # retrieved chain tokens in the tree (shared with EAGLE nodes or not)
    predicted_tokens: float = 0.0  # the budget's prediction for this round: committed tokens
    predicted_s: float = 0.0  # and round seconds (0 = no prediction: plain decoding)
    detached: bool = False  # a plain step with the drafter detached (no draft, no features sent)
    chain_accepted: int = 0  # of the retrieved chain tokens, accepted this round
    eagle_nodes: int = 0  # draft-head nodes in the tree, root excluded (0 = the head drafted nothing)
    ahead: bool = False  # the next tree was drafted ahead while this one was verified
    ahead_s: float = 0.0  # seconds that ahead draft ran (overlapping this round's verify)
    ahead_wait_s: float = 0.0  # of those, seconds the round waited for it after the verifier answered
    ahead_hit: bool = False  # this round's tree was drafted ahead (the previous round's guess hit)
    saved_s: float = 0.0  # draft seconds this round did not wait for (its ahead tree's draft time)
    run: bool = False  # a plain round whose token came from a run (DecodeRun; see the module doc)
    drafted_in_verify: bool = False  # its tree was drafted inside the previous round's Verify (round 1: the prefill)
    tree_run: bool = False  # a tree round whose verdict came from a run (VerifyRun; module doc, "Tree runs")

    @property
    def accepted(self) -> int:
        """m: the draft tokens accepted this round (accept_length - 1; 0 for the prefill)."""
        return max(self.accept_length - 1, 0)


@dataclass(frozen=True, slots=True)
class RoundOutput:
    """What `Engine.generate` yields per round (round 0 = the prefill)."""
    tokens: list[int]  # newly committed tokens, stop-truncated
    stats: RoundStats
    finish_reason: FinishReason | None = None  # once finished
    logprobs: TokenLogprobs | None = None  # of `tokens` (n = len(tokens)), when sampling.logprobs is set
    prompt_logprobs: TokenLogprobs | None = None  # round 0 only, when sampling.prompt_logprobs is set: of
    #                                               prompt tokens 1..L-1 (none after a take-over's rebuild)


def check_stop(new: list[int], produced: int, max_new_tokens: int, stop_ids: frozenset[int]
               ) -> tuple[list[int], FinishReason | None]:
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


def fixed_budget(drafter: DrafterRole | None, retrieval: bool = False) -> Budget:
    """The drafter's own shape every round (no cost model): what an Engine built without a budget
    runs. Costs are nominal (one unit per verified node), so its predictions mean nothing."""
    tree = drafter.tree if drafter is not None else TreeParams(1, 0, 2)
    return build_budget(None, None, tree, drafter is not None, retrieval)


class PlainRun(Protocol):
    """What a verifier role's `decode_run` returns: the run's tokens, one per round, read in order."""
    left: int  # tokens not read yet

    def __next__(self) -> int: ...

    def close(self) -> None:
        """Cancel the rest of the run."""


@dataclass
class _Draft:
    """The tree in flight and what `observe` needs about it."""
    tree: DraftTree | TreeOnDevice  # on the device: the head's tree as it is (no chain; Engine.device_trees)
    plan: RoundPlan
    chain_nodes: list[int]
    eagle_size: int | None  # nodes 0..eagle_size-1 came from the draft head (or the root alone); None: all
    draft_s: float
    detached: bool = False  # a plain step through Decode(keep_features): no tree is verified
    ahead_hit: bool = False  # the tree was drafted ahead (its draft_s is 0: nothing waited for it)
    saved_s: float = 0.0  # that ahead draft's own seconds
    in_verify: bool = False  # drafted inside the previous round's Verify, or the prefill (a verifier that drafts too)
    held: bool = False  # a run's next tree verified as it is, whatever the plan (Engine._drafted_in_verify)


@dataclass
class _Ahead:
    """An ahead draft in flight (or done): the drafter thread's future and what it bet on."""
    future: Future  # -> (DraftTree | None, seconds)
    guess: list[int]  # the guessed committed tokens (the ahead tree is rooted at the last)
    chain: list[int] = field(default_factory=list)  # the top path past the guess (a path of the ahead tree)
    tree: DraftTree | None = None
    ahead_s: float = 0.0


class Engine:
    def __init__(self, verifier: VerifierRole, drafter: DrafterRole | None, max_context: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] = (), budget: Budget | None = None,
                 retrieval: bool = False, ahead: AheadPolicy | None = None, guesser: Guesser | None = None,
                 plain_run: int = 0, device_trees: bool | None = None, verdict_drafts: bool | None = None,
                 verdict_ranks: bool | None = None) -> None:
        """`budget` None: the drafter's fixed shape; `retrieval`: a suffix index proposes chains;
        `ahead`: draft the next tree ahead while one is verified (module doc), guessing with
        `guesser` (None: the top path); `plain_run`: plain rounds per run at most (module doc; 0 = one
        decode call per plain round; used only with a verifier role that has `decode_run`);
        `device_trees`: trees stay on the device between draft and verify (module doc; None: wherever
        the drafter and the verifier can: one device, in process; False: never); `verdict_drafts`:
        with device trees, each greedy round's next draft is queued from its verdict on the device
        (module doc; None: wherever device trees are, without retrieval or drafting ahead; False: never);
        `verdict_ranks`: the queued draft is re-ranked as it is queued (None: with a fixed tree, whose
        plan is known then; False: by the host once it has planned, as for the adaptive budget)."""
        if plain_run < 0:
            raise InvalidRequest(f"plain_run must be >= 0; got {plain_run}")
        self.verifier = verifier
        self.drafter = drafter
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.retrieval = retrieval
        if ahead is not None and (drafter is None or not hasattr(drafter, "draft_ahead")):
            raise InvalidRequest("drafting ahead needs a drafter that can draft ahead (draft_ahead)")
        self.ahead = ahead
        if ahead is not None and hasattr(drafter, "ahead_branches") and not getattr(drafter, "num_sequences", 0):
            drafter.ahead_branches = max(drafter.ahead_branches, ahead.branches)  # type: ignore[union-attr]
        self.guesser = guesser
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._open_ahead: dict[str, _Ahead] = {}  # seq_id -> its ahead draft in flight
        self.plain_run = plain_run if hasattr(verifier, "decode_run") and not retrieval else 0
        can = (drafter is not None and getattr(drafter, "drafts_on_device", False)
               and getattr(verifier, "takes_device_trees", lambda device: False)(getattr(drafter, "device", None)))
        self.device_trees = bool(can) if device_trees is None else bool(device_trees and can)
        self._verdicts: dict[str, tuple[VerdictDraft, float]] = {}  # seq_id -> the draft queued from its verdict
        self._open_runs: dict[str, PlainRun] = {}  # seq_id -> its run of plain rounds in flight
        self._tree_runs: dict[str, Any] = {}  # seq_id -> its run of tree rounds in flight (a placement's)
        self._draft_est = 0.0  # EWMA seconds of a head draft (the policy's draft_s)
        budget = budget or fixed_budget(drafter, retrieval)
        # what the budget may use is what this engine has: a head, retrieval
        self.budget = replace(budget, eagle=budget.eagle and drafter is not None,
                              chain_limit=budget.chain_limit if retrieval else 0)
        # the latest `realized` of any greedy sequence (of this engine, or with a load board of every
        # engine sharing the verifier): where the next greedy sequence starts (it would otherwise
        # relearn it from the prior, drafting at a loss meanwhile); sampling sequences start from
        # the prior, so that a seed replays the same trees whatever ran before
        self.realized = self.budget.prior.realized
        head_only = self.budget.eagle and not retrieval and ahead is None
        self.verdict_drafts = (self.device_trees and head_only and hasattr(drafter, "draft_from_verdict")
                               and verdict_drafts is not False)
        # what became of the drafts queued from verdicts (module doc): "kept" (the plan's shape),
        # "reranked" (another size or stop), "expanded" (another top_k or depth), "plain" (the plan
        # drafts nothing: the rows stay in the draft KV), "dropped" (the host read another verdict)
        self.verdict_counts: Counter[str] = Counter()
        self.verdict_ranks = self.budget.fixed is not None if verdict_ranks is None else verdict_ranks
        largest = self.budget.fixed or self.budget.largest
        if drafter is not None and self.budget.eagle and not drafter.tree.covers(largest):
            raise InvalidRequest(f"the budget's largest tree (top_k={largest.top_k}, depth={largest.depth}, "
                                 f"size={largest.size}) does not fit the drafter's KV "
                                 f"(top_k={drafter.tree.top_k}, depth={drafter.tree.depth}, "
                                 f"size={drafter.tree.size})")

    def plain(self) -> Engine:
        """The same verifier with no draft at all: aerie's plain decoding, the baseline of a speed-up
        (in plain runs where this engine runs them: on a GPU, as `aerie generate --draft none`)."""
        return Engine(self.verifier, None, self.max_context, self.vocab_size, self.eos_token_ids,
                      plain_run=self.plain_run)

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
            raise InvalidRequest(  # vLLM's words first: clients and eval harnesses match them
                f"This model's maximum context length is {self.max_context} tokens. However, you requested {total} "
                f"tokens: prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"exceeds the model context of {self.max_context} tokens")

    def stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        eos = () if req.ignore_eos else self.eos_token_ids
        return frozenset(req.stop_token_ids) | frozenset(eos)

    def generate(self, req: GenerationRequest, seq_id: str | None = None, round_base: int = 0
                 ) -> Iterator[RoundOutput]:
        """Yield one RoundOutput after prefill (round_index 0) and one per round (round_index round_base + k, k =
        1, 2, ...: a coordinator taking a sequence over continues it at its next round); the last has
        a finish_reason."""
        self.validate(req)
        seq_id = seq_id or f"local-{next(_seq_counter)}"
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long)
        # KV rows: every committed token plus one tree (or one decode token) in flight
        tree_nodes = self.budget.max_tree_size() if self.speculates else 1
        capacity = len(req.prompt_ids) + req.max_new_tokens + tree_nodes
        stop_ids = self.stop_ids(req)
        if self.budget.load is not None:
            self.budget.load.join(seq_id)
        try:
            yield from self._run(req, seq_id, prompt, capacity, stop_ids, round_base)
        finally:
            self._close_run(seq_id)  # a stop or cancel inside a run: the verifier stops it
            self._verdicts.pop(seq_id, None)  # a draft queued from the last verdict: not needed
            self._settle(self._open_ahead.pop(seq_id, None))  # never release under a running ahead draft
            if self.budget.load is not None:
                self.budget.load.leave(seq_id)
            self.verifier.release(seq_id)
            if self.drafter:
                self.drafter.release(seq_id)

    def _run(self, req: GenerationRequest, seq_id: str, prompt: torch.Tensor, capacity: int,
             stop_ids: frozenset[int], round_base: int) -> Iterator[RoundOutput]:
        """Prefill, then rounds: verify (or decode) the planned round -> stop rules -> observe what
        was committed and plan + draft the next round -> yield."""
        seq, out = self._prefill(req, seq_id, prompt, capacity, stop_ids)
        yield out
        for round_index in itertools.count(round_base + 1):
            if out.finish_reason is not None:
                return
            done = self._round(seq_id, seq, round_index)
            new, reason = check_stop(done.tokens, seq.produced, req.max_new_tokens, stop_ids)
            logprobs = self._logprobs(req, seq_id, len(new))  # (before the next draft's calls)
            seq.produced += len(new)
            seq.root = done.tokens[-1]
            if reason is None and seq.draft is not None:
                seq.draft = self._next_draft(seq_id, seq, done)
            out = RoundOutput(new, done.stats, reason, logprobs)
            yield out

    def _prefill(self, req: GenerationRequest, seq_id: str, prompt: torch.Tensor, capacity: int,
                 stop_ids: frozenset[int]) -> tuple[_SequenceState, RoundOutput]:
        """Round 0: the verifier runs the prompt and samples the first root; a speculating engine
        starts the drafter (the prompt rows wait in `pending`) and plans + drafts round 1, or, where
        the verifier drafts it in the prefill (`_plan_in_prefill`), plans round 1 first and takes its
        tree from the prefill's answer (nothing pending: the draft KV took the prompt's rows)."""
        seq = self._new_sequence(req, -1)  # (its root: the first token)
        plan = self._plan_in_prefill(seq_id, seq, int(prompt.shape[0]))
        t0 = time.perf_counter()
        if plan is not None and plan.tree is not None:  # round 1's tree drafted in the prefill (module doc)
            assert self.drafter is not None  # (_plan_in_prefill)
            self.drafter.start(seq_id, capacity, sampling=not req.sampling.greedy)
            pre = self.verifier.prefill(seq_id, prompt, req.sampling, capacity,  # type: ignore[call-arg]
                                        first_draft=plan.tree)
        else:
            pre = self.verifier.prefill(seq_id, prompt, req.sampling, capacity)
        verify_s = time.perf_counter() - t0
        if pre.next_tree is not None:  # (the draft's seconds are round 1's draft_s)
            verify_s = max(verify_s - pre.next_draft_s, 0.0)
        seq.root = pre.first_token
        new, reason = check_stop([pre.first_token], 0, req.max_new_tokens, stop_ids)
        if reason is None and self.speculates:
            if self.drafter and pre.next_tree is None:
                if plan is None or plan.tree is None:
                    self.drafter.start(seq_id, capacity, sampling=not req.sampling.greedy)
                seq.pending_tokens.append(torch.cat([prompt[1:], torch.tensor([pre.first_token])]))
                seq.pending_features.append(pre.features)
            if seq.index is not None:
                seq.index.extend(req.prompt_ids)
                seq.index.extend([pre.first_token])
            if pre.next_tree is not None:
                assert plan is not None and plan.tree is not None and int(pre.next_tree.tokens[0]) == seq.root
                self._observe_draft(plan.tree, int(prompt.shape[0]), pre.next_draft_s)
                seq.draft = _Draft(pre.next_tree, plan, [], None, pre.next_draft_s, in_verify=True)
            else:
                seq.draft = self._draft(seq_id, seq, pre.first_token, plan=plan)
        seq.produced = len(new)
        logprobs = self._logprobs(req, seq_id, len(new))
        return seq, RoundOutput(new, RoundStats(0, 1, 0, 0, 0.0, verify_s), reason, logprobs, pre.prompt_logprobs)

    def _plan_in_prefill(self, seq_id: str, seq: _SequenceState, rows: int) -> RoundPlan | None:
        """Round 1's plan, made before the prefill where its tree may be drafted in the prefill (a
        verifier role with `drafts_first(seq_id)`: module doc, "Drafting inside the Verify"; its tree
        then comes with the first token), else None (planned after the prefill, as every round).
        Not with retrieval (its chain needs the first token) or for a request of one token."""
        drafts_first = getattr(self.verifier, "drafts_first", None)
        if (drafts_first is None or self.drafter is None or seq.index is not None or seq.max_new_tokens <= 1
                or not drafts_first(seq_id)):
            return None
        return self._plan(seq_id, seq, 0, pending_rows=rows)  # (the prompt's rows wait for the draft KV)

    def _logprobs(self, req: GenerationRequest, seq_id: str, n: int) -> TokenLogprobs | None:
        """The target's log-probabilities of the first n tokens the verifier's latest call produced
        (the round's tokens after the stop rules), when the request asks for them."""
        if req.sampling.logprobs is None:
            return None
        lp = self.verifier.take_logprobs(seq_id)
        assert lp is not None, "the verifier returned no logprobs for a sequence that asked for them"
        return lp.head(n)

    def _new_sequence(self, req: GenerationRequest, root: int) -> _SequenceState:
        seq = _SequenceState(self.budget.new_stats(), SuffixIndex() if self.retrieval else None,
                             sort_paths=not req.sampling.greedy, root=root, max_new_tokens=req.max_new_tokens,
                             policy=copy.deepcopy(self.ahead) if self.ahead is not None else None,
                             verdict_drafts=(req.sampling.greedy and req.sampling.repetition_penalty == 1.0
                                             and req.sampling.logprobs is None),
                             stop_ids=self.stop_ids(req))
        if req.sampling.greedy:  # where the latest greedy sequence left `realized` (see __init__)
            board = self.budget.load
            seq.stats.realized = board.realized if board is not None and board.realized is not None else self.realized
        return seq

    def _round(self, seq_id: str, seq: _SequenceState, round_index: int) -> _Verified:
        """Run round `round_index` as planned: a plain decode step (no speculation), a detached plain step,
        or the verification of the drafted tree (which may be the root alone)."""
        if seq.draft is None:
            return self._plain_round(seq_id, seq, round_index)
        if seq.draft.detached:
            return self._detached_round(seq_id, seq, seq.draft, round_index)
        return self._tree_round(seq_id, seq, seq.draft, round_index)

    def _plain_round(self, seq_id: str, seq: _SequenceState, round_index: int) -> _Verified:
        """Plain decoding: one token per target forward."""
        t0 = time.perf_counter()
        token, run = self._plain_token(seq_id, seq, round_index, False, seq.max_new_tokens)
        return _Verified([token], RoundStats(round_index, 1, 0, 0, 0.0, time.perf_counter() - t0, run=run))

    def _detached_round(self, seq_id: str, seq: _SequenceState, draft: _Draft, round_index: int) -> _Verified:
        """The budget chose a plain step with the drafter detached: the row's features stay on the
        verifier (they come with the next Verify)."""
        t0 = time.perf_counter()
        token, run = self._plain_token(seq_id, seq, round_index, True, self.budget.detached_rounds(seq.stats))
        stats = RoundStats(round_index, 1, 0, 0, draft.draft_s, time.perf_counter() - t0,
                           predicted_tokens=draft.plan.tokens, predicted_s=draft.plan.seconds, detached=True,
                           run=run)
        self.budget.observe_verify(draft.plan, stats.verify_s)  # (measured latency: the load board)
        return _Verified([token], stats)

    def _plain_token(self, seq_id: str, seq: _SequenceState, round_index: int, keep_features: bool,
                     rounds: int) -> tuple[int, bool]:
        """The token of plain round `round_index` and whether it came from a run: from the open run,
        else from a new run of h = min(plain_run, tokens left, `rounds`) steps when h > 1, else
        from one decode call."""
        run = self._open_runs.get(seq_id)
        if run is None:
            h = min(self.plain_run, seq.max_new_tokens - seq.produced, rounds)
            if h <= 1:
                return self.verifier.decode(seq_id, seq.root, round_index, keep_features=keep_features), False
            run = self.verifier.decode_run(seq_id, seq.root, round_index, h,  # type: ignore[attr-defined]
                                           keep_features=keep_features)
            self._open_runs[seq_id] = run
        token = next(run)
        if not run.left:
            self._open_runs.pop(seq_id, None)
        return token, True

    def _close_run(self, seq_id: str) -> None:
        for runs in (self._open_runs, self._tree_runs):
            run = runs.pop(seq_id, None)
            if run is not None:
                run.close()

    def _tree_round(self, seq_id: str, seq: _SequenceState, draft: _Draft, round_index: int) -> _Verified:
        """Verify the drafted tree, and feed what was accepted to the acceptance statistics."""
        # (a run's rounds draft at the verifier: no ahead draft beside them; the policy chooses again after
        # it. A run that drafts ahead at the verifier carries the choice instead: module doc)
        in_run = self._in_tree_run(seq_id)
        choice = None if in_run else self._choose_ahead(seq, draft)
        run_ahead = self._run_ahead(seq_id, seq, choice)
        in_verify = self._next_in_verify(seq_id, seq, draft, None) if run_ahead is not None else None
        if in_verify is None:
            run_ahead = None
        ahead = self._launch_ahead(seq_id, seq, draft, round_index, choice if run_ahead is None else None)
        t0 = time.perf_counter()
        tree = draft.tree
        hook = self._verdict_hook(seq_id, seq, draft)
        if run_ahead is not None:  # (asked above: no ahead draft from here, so the same answer)
            next_params = in_verify
        else:
            next_params = self._next_in_verify(seq_id, seq, draft, ahead) if hook is None else None
        run = self._tree_run(seq_id, seq, draft, round_index, next_params, run_ahead)
        if run is not None and not in_run and run_ahead is not None:
            seq.run_ahead = run_ahead  # (the run's rounds: RoundStats and the policy's learning)
        elif not in_run:
            seq.run_ahead = None
        try:
            # (a TreeOnDevice only reaches a verifier that takes it: device_trees; so does a hook)
            if hook is not None:
                res = self.verifier.verify(seq_id, tree, round_index, on_forward=hook)  # type: ignore[call-arg,arg-type]
            elif run is not None:  # a run of tree rounds on a verifier that drafts too (module doc)
                res = run.next(tree, round_index, next_params)
                if not run.open:  # (this round was a single Verify: the run had ended or broken)
                    self._tree_runs.pop(seq_id, None)
                    run = None
            elif next_params is not None:  # a verifier that drafts too: the next tree comes with the verdict
                res = self.verifier.verify(seq_id, tree, round_index, next_draft=next_params)  # type: ignore[call-arg,arg-type]
            else:
                res = self.verifier.verify(seq_id, tree, round_index)  # type: ignore[arg-type]
        finally:
            verify_s = time.perf_counter() - t0
            self._settle(ahead)
        self._open_ahead.pop(seq_id, None)
        wait_s = time.perf_counter() - t0 - verify_s
        if res.next_tree is not None:  # the next tree was drafted inside the call: the next round's draft_s
            verify_s = max(verify_s - res.next_draft_s, 0.0)
        tree = host_tree(tree)  # (the verifier waited for it already)
        seq.ahead = ahead
        # a run's round costs the verifier's own seconds (its hops hidden; the engine may read a round the
        # run verified long before: its wait is not the round's cost)
        self.budget.observe_verify(draft.plan, res.verify_s if run is not None and res.verify_s > 0 else verify_s)
        tokens = res.acceptance.new_tokens
        accepted = res.acceptance.nodes.tolist()
        eagle_size = tree.size if draft.eagle_size is None else draft.eagle_size
        observe(seq.stats, tree, accepted, draft.chain_nodes, eagle_size)
        observe_realized(seq.stats, draft.plan, len(tokens))
        if not seq.sort_paths:
            self.realized = seq.stats.realized
            if self.budget.load is not None:
                self.budget.load.realized = seq.stats.realized
        at_verifier = res.ahead_s > 0  # a run that drafted ahead at the verifier did, this round
        stats = RoundStats(round_index, len(tokens), tree.size if draft.plan.drafts else 0,
                           tree.max_depth, draft.draft_s, verify_s, len(draft.chain_nodes),
                           draft.plan.tokens, draft.plan.seconds,
                           chain_accepted=len(set(accepted) & set(draft.chain_nodes)),
                           eagle_nodes=eagle_size - 1, ahead=ahead is not None or at_verifier,
                           ahead_s=ahead.ahead_s if ahead else res.ahead_s,
                           ahead_wait_s=wait_s if ahead else res.ahead_wait_s,
                           ahead_hit=draft.ahead_hit, saved_s=draft.saved_s, drafted_in_verify=draft.in_verify,
                           tree_run=run is not None)
        policy = seq.policy
        if policy is not None and draft.plan.tree is not None:
            policy.observe_verdict(prefix_hits(top_guess(tree, tree.max_depth), tokens))
            if at_verifier and seq.run_ahead is not None and not res.ahead_failed:
                # its guess and chain: the top path cut as the verifier cut it (verifier_svc/ahead_run.py)
                bet = top_guess(tree, min(tree.max_depth, seq.run_ahead.max_guess))
                if (min(seq.run_ahead.depth, len(bet)) < len(tokens) <= len(bet) + 1
                        and tokens[:-1] == bet[: len(tokens) - 1]):  # on the bet + the bonus: on the tree?
                    policy.observe_ahead(res.next_ahead)
            if not seq.sort_paths:  # measured seconds: greedy sequences only (see _choose_ahead)
                # the verifier's own seconds where it reports them (the same clock in runs and single calls;
                # in a run the engine may read a round the verifier verified long before)
                own_s = res.verify_s or verify_s
                if ahead is not None:
                    policy.observe_cost(ahead.ahead_s, wait_s, own_s)
                elif at_verifier:
                    policy.observe_cost(res.ahead_s, res.ahead_wait_s, own_s)
                elif not in_run or res.verify_s > 0:
                    policy.observe_alone(own_s)
        # a next tree means the draft KV took this round's rows (asked for, or a run's round answered again)
        nxt = None
        if res.next_tree is not None:
            assert self.drafter is not None  # (a next tree comes from a drafter's process)
            nxt = (res.next_tree, res.next_draft_s, next_params or draft.plan.tree or self.drafter.tree, res.from_run)
        return _Verified(tokens, stats, res.features, nxt, pending_rows=res.pending_rows,
                         next_ahead_s=res.ahead_s if res.next_ahead else 0.0)

    def _next_in_verify(self, seq_id: str, seq: _SequenceState, draft: _Draft, ahead: _Ahead | None
                        ) -> TreeParams | None:
        """The shape to draft the next tree in during this round's Verify (module doc, "Drafting inside the
        Verify"), or None: no verifier that drafts too, retrieval or a round that drafts ahead (their rows
        and trees are the coordinator's), rows waiting for the draft KV (after an ahead hit too), or a
        round that may end the request (it can commit depth + 2 tokens: accepted nodes down to depth + 1,
        and the bonus)."""
        params = draft.plan.tree
        drafts_next = getattr(self.verifier, "drafts_next", None)
        if (params is None or drafts_next is None or self.drafter is None or seq.index is not None
                or ahead is not None or seq.pending_tokens
                or seq.max_new_tokens - seq.produced <= params.depth + 2):
            return None
        return params if drafts_next(seq_id) else None

    def _tree_run(self, seq_id: str, seq: _SequenceState, draft: _Draft, round_index: int,
                  next_params: TreeParams | None, ahead: RunAhead | None = None):
        """The sequence's open run of tree rounds, or a new one where this round drafts inside the Verify
        (`next_params`), the budget's shape is fixed (every round verifies the tree the verifier drafted
        before it, as it is) and the verifier runs them (`verify_run`): up to `plain_run` rounds, ending
        before the rounds that may end the request (those draft with a Draft call) or after a stop id."""
        run = self._tree_runs.get(seq_id)
        if run is not None and run.exhausted:  # every round it asked for was read: another run, not one Verify
            self._tree_runs.pop(seq_id).close()
            run = None
        if run is not None or next_params is None or self.plain_run < 2 or draft.held:
            return run
        if self.budget.fixed is None and seq.sort_paths:  # sampling: which rounds are held depends on timing,
            return None  # and a seed must replay the same trees (the budget's batch-1 plans: Engine._plan)
        if seq.policy is not None and not seq.sort_paths and seq.policy.needs_baseline:
            return None  # its baseline round: a run would keep the policy from choosing for up to plain_run rounds
        verify_run = getattr(self.verifier, "verify_run", None)
        left = seq.max_new_tokens - seq.produced - (next_params.depth + 2)  # (a round commits depth + 2 at most)
        if verify_run is None or left < 1 or not isinstance(draft.tree, DraftTree):
            return None
        # a run that drafts ahead is at most AHEAD_RUN rounds: the policy chooses again after it (the load it
        # measures inside the run, e.g. a drafter that many sequences' ahead drafts now keep busy, turns it off)
        run = (verify_run(seq_id, draft.tree, round_index, next_params, min(self.plain_run, AHEAD_RUN), left,
                          seq.stop_ids, ahead)
               if ahead is not None else
               verify_run(seq_id, draft.tree, round_index, next_params, self.plain_run, left, seq.stop_ids))
        if run is not None:
            self._tree_runs[seq_id] = run
        return run

    def _in_tree_run(self, seq_id: str) -> bool:
        """The sequence's open run of tree rounds has rounds left (the next round is one of them)."""
        run = self._tree_runs.get(seq_id)
        return run is not None and run.open and not run.exhausted

    def _choose_ahead(self, seq: _SequenceState, draft: _Draft) -> _Choice | None:
        """The policy's choice for the round `draft` verifies: the guess to draft the next tree ahead from
        (and the tree and its top path), or None (no policy, no tree, or drafting ahead does not pay)."""
        policy = seq.policy
        if policy is None or draft.plan.tree is None or draft.tree.size < 2:
            return None
        params = draft.plan.tree
        # a merged retrieved chain can make the tree deeper than the head's trees: the drafter takes a
        # guess of at most depth + 2 tokens and a chain of at most depth + 1 (its KV's ahead rows)
        assert self.drafter is not None  # a policy needs a drafter (__init__)
        limit = self.drafter.tree.depth + 2  # the longest guess a drafter takes
        tree = host_tree(draft.tree)  # (a sequence with a policy never leaves its tree on the device)
        path = top_guess(tree, min(tree.max_depth, limit))
        # sampling: nominal seconds, so that a seed replays the same trees whatever the timing
        draft_s = self._draft_est if not seq.sort_paths else 1.0
        step_s = draft_s / (params.depth + 2)  # one head step of the extend + depth + 1 levels
        # the drafter's load (a remote drafter reports it with each answer); sampling: 0, as above
        busy = float(getattr(self.drafter, "busy", 0.0)) if not seq.sort_paths else 0.0
        sharing = int(getattr(self.drafter, "sharing", 1)) if not seq.sort_paths else 1  # (a remote drafter's)
        depth = policy.choose(draft_s, step_s, len(path), busy=busy, sharing=sharing, chained=policy.branches > 0,
                              measured=not seq.sort_paths)
        if depth is None:
            return None
        guess = self.guesser(tree, depth, seq.produced)[:limit] if self.guesser else path[:depth]
        return _Choice(depth, guess, tree, path, limit) if guess else None

    def _run_ahead(self, seq_id: str, seq: _SequenceState, choice: _Choice | None) -> RunAhead | None:
        """Drafting ahead inside a run of tree rounds at the verifier (module doc) for this choice, where
        the verifier can (`runs_ahead`: direct drafts to a drafter in another process) and the guess is
        the top path's; with the adaptive budget, for greedy sequences (a sampling one's rounds are
        single calls: `_tree_run`). A run left early for a new shape leaves a DraftAhead in flight: the
        next Draft says where its rows go in the draft KV (the placement's `first_row`)."""
        runs_ahead = getattr(self.verifier, "runs_ahead", None)
        if (choice is None or runs_ahead is None or self.guesser is not None
                or self.budget.fixed is None and seq.sort_paths or self.plain_run < 2 or not runs_ahead(seq_id)):
            return None
        return RunAhead(choice.depth, choice.limit, seq.policy.branches, seq.sort_paths)  # type: ignore[union-attr]

    def _launch_ahead(self, seq_id: str, seq: _SequenceState, draft: _Draft, round_index: int,
                      choice: _Choice | None) -> _Ahead | None:
        """Start the ahead draft of the next tree (for round round_index + 1) on the drafter thread, as
        the policy chose (`_choose_ahead`; None: not). The pending committed rows go with it (the draft
        KV takes them now, as a draft would)."""
        if choice is None:
            return None
        params, policy, guess, tree, path = draft.plan.tree, seq.policy, choice.guess, choice.tree, choice.path
        assert params is not None and policy is not None and self.drafter is not None
        chain, exclude = chain_past(tree, guess, path)
        tokens = torch.cat(seq.pending_tokens) if seq.pending_tokens else torch.zeros(0, dtype=torch.long)
        features = torch.cat(seq.pending_features) if seq.pending_features else torch.zeros(0)
        seq.pending_tokens.clear()
        seq.pending_features.clear()
        drafter = self.drafter

        def run() -> tuple[DraftTree | None, float]:
            t0 = time.perf_counter()
            tree = drafter.draft_ahead(seq_id, tokens, features, list(guess), params,  # type: ignore[attr-defined]
                                       round_index + 1, branches=policy.branches, exclude=exclude, chain=chain)
            return tree, time.perf_counter() - t0

        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="aerie-ahead")
        ahead = _Ahead(self._ahead_pool.submit(run), list(guess), list(chain))
        self._open_ahead[seq_id] = ahead
        return ahead

    def _verdict_hook(self, seq_id: str, seq: _SequenceState, draft: _Draft
                      ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """With verdict drafts, the verifier's on_forward for this round: it queues the next draft from
        the verdict on the device (next_rows_on_device -> Drafter.draft_from_verdict) behind the
        verify's forward; `_next_draft` keeps it when the host reads the same verdict. None where this
        round cannot: a sampling or penalised sequence, rows the draft KV has not taken, a host tree;
        and the request's last round (one token left: nothing would verify that draft)."""
        tree, params = draft.tree, draft.plan.tree
        if (not self.verdict_drafts or not seq.verdict_drafts or seq.pending_tokens or params is None
                or not isinstance(tree, TreeOnDevice) or seq.max_new_tokens - seq.produced <= 1):
            return None
        drafter = self.drafter
        ranked = self.verdict_ranks  # else the host re-ranks for the plan it makes after the verdict

        def hook(argmax: torch.Tensor, features: torch.Tensor) -> None:
            t0 = time.perf_counter()
            try:
                width = drafter.next_width(params)  # type: ignore[union-attr]
                if width is None:
                    return
                rows = next_rows_on_device(tree.static, argmax, width)
                queued = drafter.draft_from_verdict(seq_id, rows, features[rows.nodes], params,  # type: ignore[union-attr]
                                                    ranked=ranked)
            except Exception:  # an optimisation only: the round goes on, and drafts after its verdict
                log.exception("queuing the next draft from the verdict failed; this engine drafts after verdicts now")
                self.verdict_drafts = False
                return
            if queued is not None:
                self._verdicts[seq_id] = (queued, time.perf_counter() - t0)

        return hook

    @staticmethod
    def _settle(ahead: _Ahead | None) -> None:
        """Wait for an ahead draft to finish (its errors are raised: the drafter's KV may be gone)."""
        if ahead is not None:
            ahead.tree, ahead.ahead_s = ahead.future.result()

    def _next_draft(self, seq_id: str, seq: _SequenceState, done: _Verified) -> _Draft:
        """The committed tokens wait for the draft KV (with their features, unless the round was
        detached: those come with the next Verify) and extend the suffix index; then the next round
        is planned and drafted."""
        assert seq.draft is not None
        if done.pending_rows:  # (a run that drafts ahead at the verifier says which rows the draft KV lacks)
            _replace_pending(seq, done)
        if done.next is not None:
            return self._drafted_in_verify(seq_id, seq, done.next, len(done.tokens), done.next_ahead_s)
        queued = self._verdicts.pop(seq_id, None)
        plan = None
        if queued is not None:  # a draft queued from this verdict (no retrieval, no ahead: __init__)
            plan = self._plan(seq_id, seq, 0)
            verdict, draft_s = queued
            if verdict.matches(done.tokens):  # the draft KV keeps the rows, and the tree if it is the plan's
                return self._from_verdict(seq_id, seq, verdict, len(done.tokens), plan, draft_s)
            self.verdict_counts["dropped"] += 1
            # the draft below writes those rows again (the draft KV's length never moved), planned as
            # just now (a plan counts idle rounds: once a round)
        if self.drafter and not done.pending_rows:
            seq.pending_tokens.append(torch.tensor(done.tokens))
            if not seq.draft.detached:
                assert done.features is not None  # an attached drafter's verify returns the features
                seq.pending_features.append(done.features)
        if seq.index is not None:
            seq.index.extend(done.tokens)
        ahead, seq.ahead = seq.ahead, None
        if ahead is None or ahead.tree is None:
            return self._draft(seq_id, seq, seq.root, plan=plan)
        hit = use_ahead(ahead.tree, ahead.guess, done.tokens, seq.sort_paths)
        bet = ahead.guess + ahead.chain  # the guess, then the chain: the bonus hangs from one of them
        if (seq.policy is not None and len(ahead.guess) < len(done.tokens) <= len(bet) + 1
                and done.tokens[:-1] == bet[: len(done.tokens) - 1]):  # on the bet + the bonus: on the tree?
            seq.policy.observe_ahead(hit is not None)
        return self._draft(seq_id, seq, seq.root, hit, ahead.ahead_s if hit is not None else 0.0)

    def _drafted_in_verify(self, seq_id: str, seq: _SequenceState,
                           drafted: tuple[DraftTree, float, TreeParams, bool], rows: int, ahead_s: float = 0.0
                           ) -> _Draft:
        """The next round from the tree the verifier's own head drafted in the Verify (its draft KV took the
        round's `rows` already): the budget plans as after any verdict; the tree is cut to the plan's shape
        (services/spec/ahead.py trim; a plan larger than the tree keeps the tree as drafted), or left
        unused for a plain round. A verdict a run computed (module doc, "Tree runs") holds the tree as it
        is when the plan changes the shape: the verifier may have verified it already, in the run; the run
        is closed, and the plan applies from the first round a run did not compute. A plan that changes
        only the dynamic-depth threshold (`TreeParams.shape` the same) keeps the run and its threshold.
        `ahead_s` > 0: the tree was drafted ahead at the verifier (a hit: no draft waited for, the round's
        rows still pending)."""
        tree, draft_s, params, from_run = drafted
        if not ahead_s:
            self._observe_draft(params, rows, draft_s)
        plan = self._plan(seq_id, seq, 0)
        if from_run and plan.tree is not None and plan.tree.shape == params.shape:
            plan = replace(plan, tree=params)  # the run's threshold for its rounds (module doc, "Tree runs")
        if from_run and plan.tree != params:
            run = self._tree_runs.pop(seq_id, None)
            if run is not None:
                run.close()  # no further round in the run's shape
            self.verdict_counts["held"] += 1
            # (the plan's predictions for its own shape; no head gain: `realized` learns nothing from it)
            return _Draft(tree, RoundPlan(params, 0, plan.tokens, plan.seconds), [], None, draft_s, in_verify=True,
                          held=True)
        if plan.tree is None:
            self.verdict_counts["plain"] += 1
            return self._draft(seq_id, seq, seq.root, plan=plan)
        assert int(tree.tokens[0]) == seq.root, (int(tree.tokens[0]), seq.root)  # rooted at the bonus
        cut = trim(tree, plan.tree, seq.sort_paths) if plan.tree != params else tree
        self.verdict_counts["kept" if cut is tree else "trimmed"] += 1  # (a new threshold may cut nothing)
        tree = cut
        return _Draft(tree, plan, [], None, draft_s, in_verify=True, ahead_hit=ahead_s > 0, saved_s=ahead_s)

    def _from_verdict(self, seq_id: str, seq: _SequenceState, verdict: VerdictDraft, rows: int, plan: RoundPlan,
                      draft_s: float) -> _Draft:
        """The next round from a draft queued from the verdict the host read too: its `rows` (the
        round's accepted tokens + bonus) committed to the draft KV; its tree where the plan is its
        shape, else the plan's tree from it (the adaptive budget plans after the verdict:
        Drafter.redraft re-ranks the same candidates or expands again, without extending again), or
        the plan's plain round (nothing pending: the KV is current)."""
        assert self.drafter is not None  # (verdict drafts)
        self.drafter.commit(seq_id, rows)  # type: ignore[attr-defined]
        if plan.tree == verdict.params and verdict.tree is not None:
            self.verdict_counts["kept"] += 1
            return _Draft(verdict.tree, plan, [], None, draft_s)
        if plan.tree is None:  # (a tree round just ran: not detached before, no run open)
            self.verdict_counts["plain"] += 1
            return self._draft(seq_id, seq, seq.root, plan=plan)
        t0 = time.perf_counter()
        tree = self.drafter.redraft(seq_id, verdict, plan.tree, seq.root)  # type: ignore[attr-defined]
        same = (plan.tree.top_k, plan.tree.depth) == (verdict.params.top_k, verdict.params.depth)
        self.verdict_counts["reranked" if same else "expanded"] += 1
        return _Draft(tree, plan, [], None, draft_s + time.perf_counter() - t0)

    def _draft(self, seq_id: str, seq: _SequenceState, root: int, ahead: DraftTree | None = None,
               saved_s: float = 0.0, plan: RoundPlan | None = None) -> _Draft:
        """Plan the next round (unless `plan` is the plan made for it already: no retrieval) and build
        its tree: EAGLE (extending the draft KV with every pending row; or `ahead`, the tree drafted
        ahead whose guess hit, leaving the pending rows for the next draft), the retrieved chain,
        both, or the root alone."""
        t0 = time.perf_counter()
        chain = seq.index.propose(self.budget.chain_limit) if seq.index is not None else []
        plan = plan if plan is not None else self._plan(seq_id, seq, len(chain))
        was_detached = seq.detached
        seq.detached = (self.budget.detach and self.drafter is not None and not plan.drafts
                        and not self.budget.probes_next(seq.stats))
        if not seq.detached and seq_id in self._open_runs:
            seq.detached = True  # a run's rounds stay plain: a plan that drafts waits for its end (module doc)
        if seq.detached:  # a plain step that leaves the drafter alone (see the module doc)
            return _Draft(root_tree(root), plan, [], 1, time.perf_counter() - t0, detached=True)
        if plan.tree is not None and was_detached:
            # the rows of the detached rounds have no features here yet: this round verifies the
            # root alone, whose answer brings them; the tree waits for the next round's plan
            plan = RoundPlan(None, 0, 1.0, 0.0)
        use = ahead is not None and plan.tree is not None
        chain = chain[: plan.chain]
        if ahead is not None and plan.tree is not None:
            assert int(ahead.tokens[0]) == root, (int(ahead.tokens[0]), root)  # rerooted at the bonus
            tree = trim(ahead, plan.tree, seq.sort_paths)  # the round's shape (an ahead tree may be larger)
        elif plan.tree is not None:
            # on the device when nothing changes it before the verify (no chain, no ahead draft's guess)
            on_device = self.device_trees and not chain and seq.policy is None
            head = self._head_tree(seq_id, seq, plan.tree, on_device)
            if isinstance(head, TreeOnDevice):
                return _Draft(head, plan, [], None, time.perf_counter() - t0)
            tree = head
        else:
            tree = root_tree(root)
        eagle_size = tree.size
        tree, chain_nodes = merge_chain(tree, chain, seq.sort_paths)
        return _Draft(tree, plan, chain_nodes, eagle_size, time.perf_counter() - t0,
                      ahead_hit=use, saved_s=saved_s if use else 0.0)

    def _plan(self, seq_id: str, seq: _SequenceState, chain: int, pending_rows: int | None = None) -> RoundPlan:
        """The budget's plan for the next round, given `chain` retrieved tokens. Alone, the rows
        waiting for the draft KV are paid whenever the head next drafts (a sunk cost): the decision
        uses a steady round's extension (root + about one accepted token); in a batch they are
        charged (Budget.plan's pending_rows). With a load board, greedy sequences size their trees
        for the batch; sampling sequences keep the batch-1 choice so that a seed replays the same
        tokens whatever the load."""
        if pending_rows is None:
            pending_rows = sum(int(t.shape[0]) for t in seq.pending_tokens)
        return self.budget.plan(seq.stats, chain, commit_rows=2.0, key=seq_id, adapt=not seq.sort_paths,
                                pending_rows=pending_rows)

    def _head_tree(self, seq_id: str, seq: _SequenceState, params: TreeParams, on_device: bool = False
                   ) -> DraftTree | TreeOnDevice:
        """The draft head's tree of shape `params`, its KV first extended with every pending row
        (`on_device`: left on the device where the drafter can, Drafter.draft)."""
        tokens = torch.cat(seq.pending_tokens)  # [P] committed tokens the draft KV has not seen
        features = torch.cat(seq.pending_features)  # [P, F] their target features
        seq.pending_tokens.clear()
        seq.pending_features.clear()
        assert self.drafter is not None  # a plan with a head tree: the engine has a drafter
        t0 = time.perf_counter()
        tree = (self.drafter.draft_on_device(seq_id, tokens, features, params)  # type: ignore[attr-defined]
                if on_device else self.drafter.draft(seq_id, tokens, features, params))
        self._observe_draft(params, int(tokens.shape[0]), time.perf_counter() - t0)
        return tree

    def _observe_draft(self, params: TreeParams, rows: int, draft_s: float) -> None:
        """A head tree of shape `params` drafted over `rows` new rows in `draft_s`: the budget's cost
        model and the overlap policy's estimate."""
        self.budget.observe_draft(params, rows, draft_s)
        self._draft_est = draft_s if self._draft_est == 0.0 else 0.8 * self._draft_est + 0.2 * draft_s


def _replace_pending(seq: _SequenceState, done: _Verified) -> None:
    """The rows the draft KV has not taken, as a run that drafts ahead at the verifier says (its
    features): the last of the rows pending before the round and the round's (the verifier's pending
    rows are a suffix of the engine's)."""
    assert done.features is not None
    n = int(done.features.shape[0])
    recent = torch.cat([*seq.pending_tokens, torch.tensor(done.tokens, dtype=torch.long)])
    assert n <= recent.shape[0], (n, recent.shape[0])
    seq.pending_tokens = [recent[recent.shape[0] - n:]] if n else []
    seq.pending_features = [done.features] if n else []


@dataclass(frozen=True, slots=True)
class _Verified:
    """What one round committed, before the stop rules."""
    tokens: list[int]  # accepted drafts + the bonus (a plain step: one token)
    stats: RoundStats
    features: torch.Tensor | None = None  # [k + m + 1, F] VerifyResult.features (None: a plain step)
    # the next tree drafted inside the Verify (a verifier that drafts too): (tree, seconds, its shape,
    # whether a run computed the verdict: VerifyResult.from_run)
    next: tuple[DraftTree, float, TreeParams, bool] | None = None
    pending_rows: bool = False  # `features` are exactly the rows the draft KV has not taken (VerifyResult)
    next_ahead_s: float = 0.0  # > 0: the next tree was drafted ahead at the verifier (its seconds)


@dataclass(frozen=True, slots=True)
class _Choice:
    """The overlap policy's choice for a round: guess `depth` tokens (module doc, "Drafting ahead")."""
    depth: int
    guess: list[int]  # the guessed committed tokens (the top path's first `depth`, or a guesser's)
    tree: DraftTree  # the round's tree (on the host)
    path: list[int]  # its top path, cut at `limit`
    limit: int  # the longest guess the drafter takes (its tree depth + 2)


@dataclass
class _SequenceState:
    stats: AcceptanceStats  # this sequence's acceptance estimates (start: the budget's prior)
    index: SuffixIndex | None  # retrieval: prompt + committed tokens
    sort_paths: bool  # sampling: paths in lexicographic order
    pending_tokens: list[torch.Tensor] = field(default_factory=list)  # committed, not yet in the draft KV
    pending_features: list[torch.Tensor] = field(default_factory=list)
    detached: bool = False  # the last planned round leaves its features on the verifier
    root: int = -1  # the last committed token: the next round's root
    produced: int = 0  # tokens streamed so far (stop-truncated)
    max_new_tokens: int = 0  # the request's (a run never asks for more tokens than it allows)
    draft: _Draft | None = None  # the planned next round (None: plain decoding, no speculation)
    ahead: _Ahead | None = None  # the ahead draft of the round just verified (until _next_draft)
    policy: AheadPolicy | None = None  # this sequence's copy of the engine's policy (None: no overlap)
    run_ahead: RunAhead | None = None  # the open run of tree rounds drafts ahead at the verifier so
    verdict_drafts: bool = False  # greedy, no penalty: its next draft may be queued from the verdict
    stop_ids: frozenset[int] = frozenset()  # the token ids that end it (Engine.stop_ids)
