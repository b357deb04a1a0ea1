"""Verifier: the target's side of speculative decoding for many sequences; prefill, tree
verification and plain decode, one target forward for a whole batch of calls.

    v = Verifier(target, feature_kind)                 # or Verifier(None, kind, runner=shared_runner)
    v.prefill(seq_id, prompt [L], sampling, capacity)  -> PrefillResult      (batch 1)
    v.verify(seq_id, tree, round_index)                -> VerifyResult
    v.decode(seq_id, token, round_index, keep_features=False) -> int
    v.decode_run(seq_id, token, round_index, steps, keep_features=False) -> a run of plain steps
    v.run([PrefillCall | VerifyCall | DecodeCall, ...]) -> [result | AerieError, ...]  (one forward)

The in-process implementation of the verifier role; the verifier service wraps this class unchanged.
It talks to the model through a runner's five methods only (services/model/runner.py: allocate, grow,
release, keep, execute), so a tensor-parallel group proxy can stand in for the local ModelRunner.
Each sequence returns the features its drafter needs (hidden / taps / none, chosen at prefill), so
one Verifier serves every kind in one forward; Verifiers sharing a runner share its KV pool.

`run` turns every valid call into one entry of one `Step` (one target forward), then accepts per
sequence: greedy acceptance reads one argmax over all the batch's rows; sampling keeps each
sequence's (seed, round) generator, so a sequence's tokens do not depend on its neighbours. A call
that is invalid (unknown sequence, KV that does not fit, ...) gets its own error in its place and
never fails the others. Acceptance itself is `services.spec.verify`; this class runs the forward
around it, compacts the KV to the accepted path and returns the accepted nodes' features.

A sequence whose drafter is detached (the budget chose plain steps) decodes with
`keep_features=True`: the verifier keeps each such row's features ([1, F], computed by the forward
anyway) and the next Verify returns them in front of its own, so nothing travels per plain step and
the drafter catches up in one draft call.

KV slots grow (services/engine/kv_growth.py; `growth_rows` > 0): a Prefill reserves its prompt and
one increment, and a call that needs more rows grows its slot first, oldest sequence first; when the
budget is full the youngest sequence is preempted (its KV released, its calls answered with
SequencePreempted, `on_preempt(seq_id)` told). growth_rows 0 reserves the caller's capacity at Prefill.

Two per-sequence options act here: a repetition penalty (services/spec/penalty.py) rewrites each
scored row's logits with that row's own context before acceptance, so greedy and sampled acceptance
both see the target's penalised distribution; `logprobs` (services/spec/logprobs.py) keeps the
target's log-probabilities of the tokens a call produced, read once with `take_logprobs(seq_id)`
(the results' types stay as they are).

`prompt_logprobs` (opt-in per sequence; OpenAI's `echo` + `logprobs`, vLLM's `prompt_logprobs`):
its prefill chunks ask the forward for the logits of every row (not the last only) and each
PrefillResult carries the target's raw log-probabilities of the prompt tokens that chunk's rows
score: row i predicts token i+1, so a first chunk of c rows scores tokens 1..c-1 (token 0 has no
prediction) and its last row's logits ([1, V]) wait in the sequence for the next chunk, whose first
token they score. Computed per chunk, `ROWS_PER_BLOCK` rows per log_softmax (services/spec/logprobs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from services.engine.kv_growth import SlotGrowth
from services.engine.plain_run import LocalPlainRun, StepwiseRun
from services.errors import AerieError, CapacityExceeded, InvalidRequest, SequenceNotFound
from services.model.runner import ModelRunner
from services.model.step import Step, StepEntry, StepOutput
from services.model.target import TargetModel
from services.model.transfer import mark, to_device_queued, to_host_queued
from services.spec.logprobs import TokenLogprobs, prompt_logprobs, token_logprobs
from services.spec.penalty import SeenTokens
from services.spec.sampling import SamplingParams, next_token, round_generator
from services.spec.tree import DraftTree, TreeOnDevice, host_tree
from services.spec.verify import Acceptance, accept, accept_greedy_argmax

if TYPE_CHECKING:
    from services.engine.roles import FeatureKind  # (roles imports this module)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int  # sampled from the last prompt row with the round-0 generator
    features: torch.Tensor  # [L, F] target features of the prompt rows
    prompt_logprobs: TokenLogprobs | None = None  # sampling.prompt_logprobs set: of the prompt tokens
    #                                               this chunk's rows score (see the module doc)
    # over gRPC, asked with next_draft (verifier_svc/first_draft.py): round 1's tree, rooted at first_token
    # (the draft KV took prompt[1:], the first token and the features: `features` is then [0, F]), its seconds
    next_tree: DraftTree | None = None
    next_draft_s: float = 0.0


def merge_prefill(parts: list[PrefillResult]) -> PrefillResult:
    """The answer for a prompt run in parts (chunks, slices), in order: the last part's first token,
    every part's features [sum c_i, F] and prompt log-probabilities (None when the parts have none)."""
    if len(parts) == 1:
        return parts[0]
    lps = [p.prompt_logprobs for p in parts if p.prompt_logprobs is not None]
    return PrefillResult(parts[-1].first_token, torch.cat([p.features for p in parts]),
                         TokenLogprobs.cat(lps) if len(lps) == len(parts) else None, parts[-1].next_tree,
                         parts[-1].next_draft_s)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    acceptance: Acceptance
    features: torch.Tensor  # [k + m + 1, F] target features of the k rows kept by Decode calls since
    #                         the previous Verify (keep_features), then of the root and the accepted
    #                         nodes ([0, H] for a sequence prefilled with feature kind "none")
    # a verifier that drafts too (over gRPC, asked with the round's next_draft): the next round's tree,
    # drafted from this verdict (the draft KV took the accepted tokens and the bonus), and its seconds
    next_tree: DraftTree | None = None
    next_draft_s: float = 0.0
    # computed by a run of tree rounds (VerifyRun: its answer, or one answered again): the verifier
    # may have verified next_tree already, as it is (the next round's, in the run)
    from_run: bool = False
    # a run that drafts ahead at the verifier (VerifyRun with `ahead`; verifier_svc/ahead_run.py): this
    # round's DraftAhead seconds and the wait for it after the verdict; next_tree is that ahead tree
    # (next_ahead); `features` are then exactly the rows the drafter's KV has not taken (pending_rows:
    # they replace the caller's); draft_index: the Drafter index of the drafter's latest answered call;
    # ahead_failed: the DraftAhead failed (the drafter's KV is unknown)
    ahead_s: float = 0.0
    ahead_wait_s: float = 0.0
    next_ahead: bool = False
    pending_rows: bool = False
    draft_index: int = 0
    ahead_failed: bool = False
    verify_s: float = 0.0  # the verifier's own seconds for this round's verify (over gRPC; 0: not reported)


@dataclass(frozen=True, slots=True)
class PrefillCall:
    seq_id: str
    prompt: torch.Tensor  # [L] long
    sampling: SamplingParams
    capacity: int  # most KV rows the sequence may use: prompt + generated tokens + one tree
    feature_kind: FeatureKind | None = None  # what this sequence returns (None: the verifier's)
    more: bool = False  # chunked prefill: `prompt` is the first chunk, PrefillMoreCalls follow (no token yet)
    prompt_rows: int = 0  # rows of the whole prompt when `prompt` is its first chunk: admission reserves
    #                       KV for all of them (a prompt is never admitted in part); 0 = this call's rows

    @property
    def rows(self) -> int:
        return int(self.prompt.shape[0])


@dataclass(frozen=True, slots=True)
class PrefillMoreCall:
    """The next chunk of a chunked prefill (after a PrefillCall with more=True); `last` samples the
    first token (PrefillResult.first_token is -1 before)."""
    seq_id: str
    prompt: torch.Tensor  # [C] long: the next prompt tokens
    last: bool

    @property
    def rows(self) -> int:
        return int(self.prompt.shape[0])


@dataclass(frozen=True, slots=True)
class VerifyCall:
    seq_id: str
    tree: DraftTree | TreeOnDevice  # on the device: the in-process engine's (services/spec/tree.py)
    round_index: int
    # in process, a greedy sequence without a penalty: called with the target's argmax [N] and features
    # [N, F] at the tree's nodes, on the device, once its forward is queued and before anything is read
    # back (the engine queues the next draft from them; the argmax's host copy is queued before it)
    on_forward: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    @property
    def rows(self) -> int:
        return self.tree.size


@dataclass(frozen=True, slots=True)
class DecodeCall:
    seq_id: str
    token: int | torch.Tensor  # the last committed token (commit it, return the next); a [1] device
    #                            tensor (a plain run's previous argmax) with on_device
    round_index: int
    keep_features: bool = False  # keep this row's features for the next Verify (a detached drafter)
    on_device: bool = False  # greedy only: the next token comes back as a [1] device tensor, not read
    #                          on the host (services/engine/plain_run.py)

    @property
    def rows(self) -> int:
        return 1


Call = PrefillCall | PrefillMoreCall | VerifyCall | DecodeCall
Result = PrefillResult | VerifyResult | int | torch.Tensor  # a Tensor: DecodeCall.on_device's [1] token


def _on_device(call: Call) -> bool:
    return isinstance(call, DecodeCall) and call.on_device


@dataclass
class _Sequence:
    slot: int  # KV slot in the runner's pool
    length: int  # committed KV rows
    capacity: int  # most rows the sequence may use (the Prefill's)
    reserved: int  # rows its slot holds now (<= capacity; grows, services/engine/kv_growth.py)
    age: int  # admission counter: larger = admitted later (the first to be preempted)
    sampling: SamplingParams
    feature_kind: FeatureKind
    prefilling: bool = False  # a chunked prefill is under way (no verify or decode yet)
    kept: list[torch.Tensor] = field(default_factory=list)  # [1, F] per Decode with keep_features
    seen: SeenTokens | None = None  # the committed context, when the sequence has a repetition penalty
    prompt_tail: torch.Tensor | None = None  # [1, V] logits of the latest prefill chunk's last row,
    #                                          which scores the next chunk's first token (prompt_logprobs)


class Verifier:
    def __init__(self, target: TargetModel | None, feature_kind: FeatureKind = "hidden", max_sequences: int = 64,
                 runner: ModelRunner | None = None, growth_rows: int = 0,
                 on_preempt: Callable[[str], None] | None = None,
                 on_grow: Callable[[str, int], None] | None = None) -> None:
        """`runner`: a shared runner (or a tensor-parallel proxy with its five methods); None = a
        ModelRunner of its own over `target` with an unbounded pool. `growth_rows`: the KV growth
        increment (0: reserve each sequence's capacity at Prefill); `on_preempt(seq_id)` after a
        preemption released a sequence, `on_grow(seq_id, reserved)` after a slot grew (worker thread)."""
        assert feature_kind in ("hidden", "taps", "none"), feature_kind
        if runner is None:
            if target is None:
                raise ValueError("a Verifier needs a target or a runner; got neither")
            runner = ModelRunner(target)
        self.runner = runner
        self.target = target if target is not None else getattr(self.runner, "target", None)
        self.feature_kind = feature_kind
        self.max_sequences = max_sequences
        self.growth = SlotGrowth(growth_rows, on_grow, on_preempt)
        self._seqs: dict[str, _Sequence] = {}
        self._logprobs: dict[str, TokenLogprobs] = {}  # the latest call's, for sequences that ask

    def take_logprobs(self, seq_id: str) -> TokenLogprobs | None:
        """The target's log-probabilities of the tokens the latest prefill / verify / decode of
        `seq_id` produced (None unless its SamplingParams.logprobs is set); read once."""
        return self._logprobs.pop(seq_id, None)

    def length(self, seq_id: str) -> int:
        """The KV rows `seq_id` holds (0: not here): the prefix its next rows attend to."""
        seq = self._seqs.get(seq_id)
        return seq.length if seq is not None else 0

    # ---- batch 1 ---------------------------------------------------------------------------------

    def prefill(self, seq_id: str, prompt: torch.Tensor, sampling: SamplingParams, capacity: int,
                feature_kind: FeatureKind | None = None) -> PrefillResult:
        """prompt [L]; `capacity` KV rows (prompt + generated tokens + one tree); `feature_kind`
        the features this sequence's results carry (None: the verifier's own)."""
        return self._one(PrefillCall(seq_id, prompt, sampling, capacity, feature_kind))

    def verify(self, seq_id: str, tree: DraftTree | TreeOnDevice, round_index: int,
               on_forward: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> VerifyResult:
        """Run the tree in one forward, accept, keep the accepted path's KV. A TreeOnDevice (on this
        verifier's device: `takes_device_trees`) is queued as it is; its host tree is waited for after.
        `on_forward` (in process): see VerifyCall."""
        return self._one(VerifyCall(seq_id, tree, round_index, on_forward))

    def takes_device_trees(self, device: torch.device) -> bool:
        """Whether a TreeOnDevice on `device` can be verified without a host read before the forward:
        a ModelRunner with the static-shape forward (a paged pool) on that device."""
        runner = self.runner
        return isinstance(runner, ModelRunner) and runner.uniform is not None and runner.device == device

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int:
        """Plain autoregressive step (the no-draft baseline): commit `token`, return the next one.
        `keep_features`: keep the row's features for the next Verify (see the module doc)."""
        return self._one(DecodeCall(seq_id, token, round_index, keep_features))

    def decode_run(self, seq_id: str, token: int, round_index: int, steps: int,
                   keep_features: bool = False) -> LocalPlainRun | StepwiseRun:
        """`steps` plain steps from round `round_index` (the engine's PlainRun): each step queued on
        the device before the previous token is read, for a greedy sequence without a repetition
        penalty or logprobs on a local ModelRunner; else one Decode per token (services/engine/plain_run.py)."""
        self._get(seq_id)  # (SequenceNotFound)
        run = LocalPlainRun if self.queues_runs(seq_id) else StepwiseRun
        return run(self, seq_id, token, round_index, steps, keep_features)

    def queues_runs(self, seq_id: str) -> bool:
        """Whether `seq_id`'s plain steps can be queued on the device before the previous token is read
        (DecodeCall.on_device): greedy, without a repetition penalty or logprobs, on a local ModelRunner
        (not a tensor-parallel one). False for a sequence this verifier does not hold."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        s = seq.sampling
        return s.greedy and s.repetition_penalty == 1.0 and s.logprobs is None and isinstance(self.runner, ModelRunner)

    def decode_on_device(self, seq_id: str, token: int | torch.Tensor, round_index: int,
                         keep_features: bool = False) -> torch.Tensor:
        """A greedy Decode whose next token stays on the device ([1] long, nothing read on the host);
        `token` may be such a tensor (the previous step's)."""
        if not self._get(seq_id).sampling.greedy:
            raise InvalidRequest(f"sequence {seq_id!r} samples: its next token cannot stay on the device")
        return self._one(DecodeCall(seq_id, token, round_index, keep_features, on_device=True))

    def undo_decode(self, seq_id: str, keep_features: bool) -> None:
        """Drop `seq_id`'s latest decoded row (a plain run's step queued past its last token read) and
        the features that step kept; nothing when the sequence has gone."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        seq.length -= 1
        self.runner.keep(seq.slot, seq.length, [])
        if keep_features and seq.feature_kind != "none" and seq.kept:  # ("none" keeps nothing)
            seq.kept.pop()

    def _one(self, call: Call):
        out = self.run([call])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    # ---- a batch: one target forward ---------------------------------------------------------------

    def run(self, calls: list[Call]) -> list[Result | AerieError]:
        """One target forward for every valid call, in order; an invalid call's error (an
        AerieError) takes its place in the returned list and the others run without it."""
        results: list[Result | AerieError | None] = [None] * len(calls)
        entries: list[StepEntry] = []
        index: list[int] = []  # call index of each entry
        new_slots: dict[int, int] = {}  # call index -> slot allocated for a prefill
        seen: set[str] = set()
        if self.growth.rows:
            pool = getattr(self.runner, "pool", None)
            self.growth.grow(self._seqs, [c for c in calls if not isinstance(c, PrefillCall)], self.runner,
                             self.release, pool.budget_text() if pool is not None else "the KV budget")
        for i, call in enumerate(calls):
            try:
                if call.seq_id in seen:
                    raise InvalidRequest(f"sequence {call.seq_id!r} has two calls in one batch")
                entry = self._entry(call, new_slots, i)
            except AerieError as e:
                results[i] = e
                continue
            seen.add(call.seq_id)
            entries.append(entry)
            index.append(i)
        if entries:
            try:
                out = self.runner.execute(Step(tuple(entries), want_taps=any(
                    self._kind(calls[i]) == "taps" for i in index)))
            except BaseException:
                for slot in new_slots.values():
                    self.runner.release(slot)
                raise
            argmax: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # entry -> host argmax, its event
            for j, i in enumerate(index):
                hook = getattr(calls[i], "on_forward", None)
                s = self._sampling(calls[i])
                if hook is not None and s.greedy and s.repetition_penalty == 1.0:  # before anything is read back
                    am = out.logits[j].argmax(-1)
                    argmax[j] = (to_host_queued(am), mark(am.device))  # (queued before the hook's kernels)
                    hook(am, self._features(out, j, self._kind(calls[i])))
            for j, result in enumerate(self._finish([calls[i] for i in index], out, new_slots, index, argmax)):
                results[index[j]] = result
        return results  # type: ignore[return-value]

    def _entry(self, call: Call, new_slots: dict[int, int], i: int) -> StepEntry:
        if isinstance(call, PrefillCall):
            if call.seq_id in self._seqs:
                raise InvalidRequest(f"sequence {call.seq_id!r} already exists on this verifier")
            if len(self._seqs) + len(new_slots) >= self.max_sequences:
                raise CapacityExceeded(f"verifier holds its maximum of {self.max_sequences} sequences")
            if call.feature_kind not in (None, "hidden", "taps", "none"):
                raise InvalidRequest(f"feature kind must be hidden, taps or none; got {call.feature_kind!r}")
            if call.rows < 1:
                raise InvalidRequest("prompt is empty: give at least one token")
            if call.capacity < call.rows:
                raise CapacityExceeded(f"KV capacity {call.capacity} is smaller than the {call.rows}-token prompt")
            pool = getattr(self.runner, "pool", None)
            if pool is not None and pool.max_rows is not None and call.capacity > pool.max_rows:
                raise pool.refusal(call.capacity)  # could not finish even alone: refused at once
            slot = self.runner.allocate(self.first_rows(call))  # CapacityExceeded: nothing admitted
            new_slots[i] = slot
            return StepEntry(slot, call.prompt.long(), logits=self._prefill_rows(call.sampling))
        seq = self._get(call.seq_id)
        if isinstance(call, PrefillMoreCall) != seq.prefilling:
            raise InvalidRequest(f"sequence {call.seq_id!r} " + ("is still being prefilled" if seq.prefilling
                                                                 else "is not being prefilled"))
        if seq.length + call.rows > seq.reserved:
            raise CapacityExceeded(f"sequence {call.seq_id!r} may use {seq.capacity} KV rows; {seq.length} used, "
                                   f"{call.rows} more requested")
        if isinstance(call, PrefillMoreCall):
            if call.rows < 1:
                raise InvalidRequest("a prefill chunk needs at least one token")
            return StepEntry(seq.slot, call.prompt.long(), logits=self._prefill_rows(seq.sampling))
        if isinstance(call, VerifyCall):
            tree = call.tree
            return StepEntry(seq.slot, tree.tokens, seq.length + tree.depths, tree.mask)  # moved by the runner
        if isinstance(call.token, torch.Tensor):  # on the device already: the runner copies it there
            return StepEntry(seq.slot, call.token.view(1), logits="last")
        return StepEntry(seq.slot, torch.tensor([call.token], device="cpu"), logits="last")  # the runner moves it

    def _finish(self, calls: list[Call], out: StepOutput, new_slots: dict[int, int], index: list[int],
                queued: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] | None = None) -> list[Result]:
        """`queued`: entries whose argmax's host copy is on its way already (an on_forward hook's)."""
        queued = queued or {}
        # the rows acceptance reads: the target's logits, penalised per row for a repetition penalty
        seen = {j: self._seen(c, out.logits[j]) for j, c in enumerate(calls)
                if self._sampling(c).repetition_penalty != 1.0}
        logits = [self._penalized(c, out.logits[j], seen.get(j)) for j, c in enumerate(calls)]
        # greedy: one argmax over every greedy entry's rows
        greedy = [j for j, c in enumerate(calls) if self._sampling(c).greedy and j not in queued]
        argmax: dict[int, torch.Tensor] = {}
        for j, (host, copied) in queued.items():
            if copied is not None:
                copied.synchronize()  # (not the kernels queued after it)
            argmax[j] = host
        last: dict[int, int] = {}  # each greedy entry's last-row argmax, on the host
        if greedy:
            rows = [logits[j] for j in greedy]
            flat = torch.argmax(torch.cat(rows) if len(rows) > 1 else rows[0], dim=-1)
            sizes = [r.shape[0] for r in rows]
            for j, a in zip(greedy, flat.split(sizes), strict=True):
                argmax[j] = a
            # decodes and prefills read only their last row's token: one device-to-host copy for all
            # of them (a tree's acceptance makes its own, its round's one copy)
            ends = torch.tensor(sizes, device="cpu").cumsum(0).sub_(1)
            wants = [n for n, j in enumerate(greedy)
                     if not isinstance(calls[j], VerifyCall) and not _on_device(calls[j])]
            if wants:
                picked = flat.index_select(0, ends[wants].to(flat.device)).tolist()
                last = {greedy[n]: tok for n, tok in zip(wants, picked, strict=True)}
        results: list[Result] = []
        for j, call in enumerate(calls):
            features = self._features(out, j, self._kind(call))
            if isinstance(call, PrefillCall):
                slot = new_slots[index[j]]
                self._seqs[call.seq_id] = _Sequence(slot, call.rows, call.capacity,
                                                    self.first_rows(call), self.growth.next_age(),
                                                    call.sampling, self._kind(call), prefilling=call.more,
                                                    seen=seen.get(j))
                self.growth.admitted(call.seq_id)
                first = -1 if call.more else (last[j] if j in last
                         else next_token(logits[j][-1], call.sampling,
                                     round_generator(call.sampling.seed, 0, out.logits[j].device)))
                self._keep_logprobs(call.seq_id, out.logits[j][-1:], [first] if first >= 0 else [])
                results.append(PrefillResult(first, features, self._score_prompt(call.seq_id, out.logits[j],
                                                                                 call.prompt, not call.more)))
                continue
            seq = self._seqs[call.seq_id]
            if isinstance(call, PrefillMoreCall):
                seq.length += call.rows
                first = -1
                if call.last:
                    seq.prefilling = False
                    first = (last[j] if j in last
                             else next_token(logits[j][-1], seq.sampling,
                                             round_generator(seq.sampling.seed, 0, out.logits[j].device)))
                    self._keep_logprobs(call.seq_id, out.logits[j][-1:], [first])
                results.append(PrefillResult(first, features, self._score_prompt(call.seq_id, out.logits[j],
                                                                                 call.prompt, call.last)))
                continue
            gen = (None if seq.sampling.greedy  # drawn on the logits' device: a CPU generator cannot draw from CUDA
                   else round_generator(seq.sampling.seed, call.round_index, out.logits[j].device))
            if isinstance(call, DecodeCall):
                seq.length += 1
                if call.keep_features and features.shape[0]:
                    seq.kept.append(features.clone())  # one row: not a view holding the batch's hidden
                if call.on_device:  # greedy (decode_run checked): the argmax stays on the device
                    results.append(argmax[j][-1:])
                    continue
                token = last[j] if j in last else next_token(logits[j][-1], seq.sampling, gen)
                self._keep_logprobs(call.seq_id, out.logits[j][-1:], [token])
                results.append(token)
                continue
            tree = host_tree(call.tree)  # (a TreeOnDevice's: its forward is queued already)
            # greedy: one host copy of the argmax, the walk on the host tree; rows past a TreeOnDevice's
            # host tree (dynamic depth's padding) are never read
            acc = (accept_greedy_argmax(tree, argmax[j]) if j in argmax
                   else accept(tree, logits[j][:tree.size], seq.sampling, gen))
            if seq.sampling.logprobs is not None:  # (the gather only when asked: a [m+1, V] copy)
                self._keep_logprobs(call.seq_id, out.logits[j][acc.nodes.to(out.logits[j].device)], acc.new_tokens)
            if seq.seen is not None:
                seq.seen.add(acc.tokens)  # the root and the accepted tokens are committed now
            self.runner.keep(seq.slot, seq.length, seq.length + acc.nodes.cpu())
            seq.length += int(acc.nodes.numel())
            if features.shape[0]:  # (the index copied in stream order: a queued next draft is not waited for)
                features = features.index_select(0, to_device_queued(acc.nodes, features.device))
            if seq.kept:
                features = torch.cat([*seq.kept, features])
                seq.kept.clear()
            results.append(VerifyResult(acc, features))
        return results

    # ---- KV growth and preemption (services/engine/kv_growth.py) ------------------------------------

    def first_rows(self, call: PrefillCall) -> int:
        """KV rows the Prefill `call` reserves: its whole prompt and one growth increment."""
        return self.growth.first_rows(max(call.rows, call.prompt_rows), call.capacity)

    def reserved(self, seq_id: str) -> int:
        """KV rows `seq_id`'s slot holds now (0 when it holds none)."""
        seq = self._seqs.get(seq_id)
        return seq.reserved if seq is not None else 0

    def not_found(self, seq_id: str) -> SequenceNotFound:
        """The error for a call on `seq_id`, which this verifier does not hold (SequencePreempted
        when it was preempted)."""
        return self.growth.not_found(seq_id)

    def _seen(self, call: Call, logits: torch.Tensor) -> SeenTokens:
        """The committed context of a penalised sequence, with what this call commits before its
        logits are read (the prompt, a prefill chunk, a decode step's token); a tree's own tokens
        are added per node by `_penalized` and kept after acceptance."""
        if isinstance(call, PrefillCall):
            seen = SeenTokens(logits.shape[-1], logits.device)
        else:
            kept = self._seqs[call.seq_id].seen
            assert kept is not None, f"penalised sequence {call.seq_id!r} lost the SeenTokens its prefill made"
            seen = kept
        if isinstance(call, (PrefillCall, PrefillMoreCall)):
            seen.add(call.prompt)
        elif isinstance(call, DecodeCall):
            seen.add([int(call.token)])  # (a penalised sequence never decodes on the device: decode_run)
        return seen

    def _penalized(self, call: Call, logits: torch.Tensor, seen: SeenTokens | None) -> torch.Tensor:
        """logits [R, V] -> the rows the acceptance reads ([R, V]; unchanged without a penalty)."""
        if seen is None:
            return logits
        penalty = self._sampling(call).repetition_penalty
        if isinstance(call, VerifyCall):
            return seen.penalize(logits, penalty, call.tree.tokens, call.tree.mask)
        return seen.penalize(logits, penalty)

    def _keep_logprobs(self, seq_id: str, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits [n, V]: the target's raw logits of the rows that produced tokens [n]."""
        top = self._seqs[seq_id].sampling.logprobs
        if top is not None and tokens:
            self._logprobs[seq_id] = token_logprobs(logits, tokens, top)

    @staticmethod
    def _prefill_rows(sampling: SamplingParams) -> Literal["all", "last"]:
        """Which rows of a prefill chunk get logits: every row for a sequence that asked for its prompt's
        log-probabilities, else the last (the first token's) only."""
        return "last" if sampling.prompt_logprobs is None else "all"

    def _score_prompt(self, seq_id: str, logits: torch.Tensor, prompt: torch.Tensor, last: bool
                      ) -> TokenLogprobs | None:
        """logits [c, V] of a prefill chunk's rows, prompt [c] its tokens -> the log-probabilities of
        the tokens these rows score (the chunk's tokens but the first, and that one from the previous
        chunk's last row when there was one); keeps this chunk's last row for the next chunk unless
        `last`. None when the sequence did not ask. Example: chunks [t0 t1 t2] [t3 t4] -> t1 t2 | t3 t4."""
        seq = self._seqs[seq_id]
        top = seq.sampling.prompt_logprobs
        if top is None:
            return None
        tail, seq.prompt_tail = seq.prompt_tail, (None if last else logits[-1:].clone())
        rows = prompt_logprobs(logits[:-1], prompt[1:], top)  # (a view: no copy of the chunk's logits)
        return rows if tail is None else TokenLogprobs.cat([prompt_logprobs(tail, prompt[:1], top), rows])

    def _kind(self, call: Call) -> FeatureKind:
        if isinstance(call, PrefillCall):
            return call.feature_kind or self.feature_kind
        return self._seqs[call.seq_id].feature_kind

    def _sampling(self, call: Call) -> SamplingParams:
        return call.sampling if isinstance(call, PrefillCall) else self._seqs[call.seq_id].sampling

    def release(self, seq_id: str) -> None:
        """Free `seq_id`'s KV (a preempted sequence stays known as preempted until it is prefilled again)."""
        seq = self._seqs.pop(seq_id, None)
        self._logprobs.pop(seq_id, None)
        if seq is not None:
            self.runner.release(seq.slot)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def _get(self, seq_id: str) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise self.not_found(seq_id) from None

    @staticmethod
    def _features(out: StepOutput, j: int, kind: FeatureKind) -> torch.Tensor:
        if kind == "taps":
            taps = out.taps_of(j)
            assert taps is not None, "a step with a taps sequence runs with want_taps"
            return taps
        hidden = out.hidden_of(j)
        return hidden if kind == "hidden" else hidden[:0]
