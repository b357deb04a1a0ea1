"""Verifier: the target's side of speculative decoding for many sequences; prefill, tree
verification and plain decode, one target forward for a whole batch of calls.

    v = Verifier(target, feature_kind)                 # or Verifier(None, kind, runner=shared_runner)
    v.prefill(seq_id, prompt [L], sampling, capacity)  -> PrefillResult      (batch 1)
    v.verify(seq_id, tree, round_index)                -> VerifyResult
    v.decode(seq_id, token, round_index, keep_features=False) -> int
    v.run([PrefillCall | VerifyCall | DecodeCall, ...]) -> [result | AerieError, ...]  (one forward)

The in-process implementation of the verifier role; the verifier service wraps this class unchanged.
It talks to the model through a runner's four methods only (services/model/runner.py: allocate,
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

Two per-sequence options act here: a repetition penalty (services/spec/penalty.py) rewrites each
scored row's logits with that row's own context before acceptance, so greedy and sampled acceptance
both see the target's penalised distribution; `logprobs` (services/spec/logprobs.py) keeps the
target's log-probabilities of the tokens a call produced, read once with `take_logprobs(seq_id)`
(the results' types stay as they are).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.errors import AerieError, CapacityExceeded, InvalidRequest, SequenceNotFound
from services.model.runner import ModelRunner
from services.model.step import Step, StepEntry, StepOutput
from services.model.target import TargetModel
from services.spec.logprobs import TokenLogprobs, token_logprobs
from services.spec.penalty import SeenTokens
from services.spec.sampling import SamplingParams, next_token, round_generator
from services.spec.tree import DraftTree
from services.spec.verify import Acceptance, accept, accept_greedy_argmax

if TYPE_CHECKING:
    from services.engine.roles import FeatureKind  # (roles imports this module)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int  # sampled from the last prompt row with the round-0 generator
    features: torch.Tensor  # [L, F] target features of the prompt rows


@dataclass(frozen=True, slots=True)
class VerifyResult:
    acceptance: Acceptance
    features: torch.Tensor  # [k + m + 1, F] target features of the k rows kept by Decode calls since
    #                         the previous Verify (keep_features), then of the root and the accepted
    #                         nodes ([0, H] for a sequence prefilled with feature kind "none")


@dataclass(frozen=True, slots=True)
class PrefillCall:
    seq_id: str
    prompt: torch.Tensor  # [L] long
    sampling: SamplingParams
    capacity: int  # KV rows: prompt + generated tokens + one tree
    feature_kind: FeatureKind | None = None  # what this sequence returns (None: the verifier's)
    more: bool = False  # chunked prefill: `prompt` is the first chunk, PrefillMoreCalls follow (no token yet)

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
    tree: DraftTree
    round_index: int

    @property
    def rows(self) -> int:
        return self.tree.size


@dataclass(frozen=True, slots=True)
class DecodeCall:
    seq_id: str
    token: int  # the last committed token (commit it, return the next)
    round_index: int
    keep_features: bool = False  # keep this row's features for the next Verify (a detached drafter)

    @property
    def rows(self) -> int:
        return 1


Call = PrefillCall | PrefillMoreCall | VerifyCall | DecodeCall
Result = PrefillResult | VerifyResult | int


@dataclass
class _Sequence:
    slot: int  # KV slot in the runner's pool
    length: int  # committed KV rows
    capacity: int
    sampling: SamplingParams
    feature_kind: FeatureKind
    prefilling: bool = False  # a chunked prefill is under way (no verify or decode yet)
    kept: list[torch.Tensor] = field(default_factory=list)  # [1, F] per Decode with keep_features
    seen: SeenTokens | None = None  # the committed context, when the sequence has a repetition penalty


class Verifier:
    def __init__(self, target: TargetModel | None, feature_kind: FeatureKind = "hidden", max_sequences: int = 64,
                 runner: ModelRunner | None = None) -> None:
        """`runner`: a shared runner (or a tensor-parallel proxy with its four methods); None = a
        ModelRunner of its own over `target` with an unbounded pool."""
        assert feature_kind in ("hidden", "taps", "none"), feature_kind
        if runner is None:
            if target is None:
                raise ValueError("a Verifier needs a target or a runner; got neither")
            runner = ModelRunner(target)
        self.runner = runner
        self.target = target if target is not None else getattr(self.runner, "target", None)
        self.feature_kind = feature_kind
        self.max_sequences = max_sequences
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

    def verify(self, seq_id: str, tree: DraftTree, round_index: int) -> VerifyResult:
        """Run the tree in one forward, accept, keep the accepted path's KV."""
        return self._one(VerifyCall(seq_id, tree, round_index))

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int:
        """Plain autoregressive step (the no-draft baseline): commit `token`, return the next one.
        `keep_features`: keep the row's features for the next Verify (see the module doc)."""
        return self._one(DecodeCall(seq_id, token, round_index, keep_features))

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
            for j, result in enumerate(self._finish([calls[i] for i in index], out, new_slots, index)):
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
            slot = self.runner.allocate(call.capacity)  # CapacityExceeded: nothing admitted
            new_slots[i] = slot
            return StepEntry(slot, call.prompt.long(), logits="last")
        seq = self._get(call.seq_id)
        if isinstance(call, PrefillMoreCall) != seq.prefilling:
            raise InvalidRequest(f"sequence {call.seq_id!r} " + ("is still being prefilled" if seq.prefilling
                                                                 else "is not being prefilled"))
        if seq.length + call.rows > seq.capacity:
            raise CapacityExceeded(f"sequence {call.seq_id!r} holds {seq.capacity} KV rows; {seq.length} used, "
                                   f"{call.rows} more requested")
        if isinstance(call, PrefillMoreCall):
            if call.rows < 1:
                raise InvalidRequest("a prefill chunk needs at least one token")
            return StepEntry(seq.slot, call.prompt.long(), logits="last")
        if isinstance(call, VerifyCall):
            tree = call.tree
            return StepEntry(seq.slot, tree.tokens, seq.length + tree.depths, tree.mask)  # moved by the runner
        return StepEntry(seq.slot, torch.tensor([call.token], device="cpu"), logits="last")  # the runner moves it

    def _finish(self, calls: list[Call], out: StepOutput, new_slots: dict[int, int], index: list[int]
                ) -> list[Result]:
        # the rows acceptance reads: the target's logits, penalised per row for a repetition penalty
        seen = {j: self._seen(c, out.logits[j]) for j, c in enumerate(calls)
                if self._sampling(c).repetition_penalty != 1.0}
        logits = [self._penalized(c, out.logits[j], seen.get(j)) for j, c in enumerate(calls)]
        # greedy: one argmax over every greedy entry's rows
        greedy = [j for j, c in enumerate(calls) if self._sampling(c).greedy]
        argmax: dict[int, torch.Tensor] = {}
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
            wants = [n for n, j in enumerate(greedy) if not isinstance(calls[j], VerifyCall)]
            if wants:
                picked = flat.index_select(0, ends[wants].to(flat.device)).tolist()
                last = {greedy[n]: tok for n, tok in zip(wants, picked, strict=True)}
        results: list[Result] = []
        for j, call in enumerate(calls):
            features = self._features(out, j, self._kind(call))
            if isinstance(call, PrefillCall):
                slot = new_slots[index[j]]
                self._seqs[call.seq_id] = _Sequence(slot, call.rows, call.capacity, call.sampling,
                                                    self._kind(call), prefilling=call.more, seen=seen.get(j))
                first = -1 if call.more else (last[j] if j in last
                         else next_token(logits[j][-1], call.sampling,
                                     round_generator(call.sampling.seed, 0, out.logits[j].device)))
                self._keep_logprobs(call.seq_id, out.logits[j][-1:], [first] if first >= 0 else [])
                results.append(PrefillResult(first, features))
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
                results.append(PrefillResult(first, features))
                continue
            gen = (None if seq.sampling.greedy  # drawn on the logits' device: a CPU generator cannot draw from CUDA
                   else round_generator(seq.sampling.seed, call.round_index, out.logits[j].device))
            if isinstance(call, DecodeCall):
                seq.length += 1
                if call.keep_features and features.shape[0]:
                    seq.kept.append(features.clone())  # one row: not a view holding the batch's hidden
                token = last[j] if j in last else next_token(logits[j][-1], seq.sampling, gen)
                self._keep_logprobs(call.seq_id, out.logits[j][-1:], [token])
                results.append(token)
                continue
            tree = call.tree
            # greedy: the tree joins the argmax on the model's device; one host copy of the accepted path
            acc = (accept_greedy_argmax(tree, argmax[j]) if j in argmax
                   else accept(tree, logits[j], seq.sampling, gen))
            self._keep_logprobs(call.seq_id, out.logits[j][acc.nodes.to(out.logits[j].device)], acc.new_tokens)
            if seq.seen is not None:
                seq.seen.add(acc.tokens)  # the root and the accepted tokens are committed now
            self.runner.keep(seq.slot, seq.length, seq.length + acc.nodes.cpu())
            seq.length += int(acc.nodes.numel())
            features = features[acc.nodes] if features.shape[0] else features
            if seq.kept:
                features = torch.cat([*seq.kept, features])
                seq.kept.clear()
            results.append(VerifyResult(acc, features))
        return results

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
            seen.add([call.token])
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

    def _kind(self, call: Call) -> FeatureKind:
        if isinstance(call, PrefillCall):
            return call.feature_kind or self.feature_kind
        return self._seqs[call.seq_id].feature_kind

    def _sampling(self, call: Call) -> SamplingParams:
        return call.sampling if isinstance(call, PrefillCall) else self._seqs[call.seq_id].sampling

    def release(self, seq_id: str) -> None:
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
            raise SequenceNotFound(f"unknown sequence {seq_id!r} on this verifier") from None

    @staticmethod
    def _features(out: StepOutput, j: int, kind: FeatureKind) -> torch.Tensor:
        if kind == "taps":
            taps = out.taps_of(j)
            assert taps is not None, "a step with a taps sequence runs with want_taps"
            return taps
        hidden = out.hidden_of(j)
        return hidden if kind == "hidden" else hidden[:0]
