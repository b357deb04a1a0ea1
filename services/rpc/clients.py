"""The gRPC implementations of the engine's roles (`services.engine.roles`): `RemoteVerifier` and
`RemoteDrafter` have the in-process classes' methods and results, so `Engine` drives them unchanged.

    verifiers = VerifierClient("10.0.0.7:50052", max_message_bytes, timeout_s)   # one per replica
    engine = Engine(verifiers.for_sequence(kind, phases), drafters.for_sequence(phases), ...)

`VerifierClient` / `DrafterClient` hold one channel per replica, shared by every sequence placed
there; `for_sequence` returns the per-sequence role object. Every call has a deadline; a failed call
raises `DownstreamError` naming the replica and keeping the downstream status code. `phases` (see
`Phases`) lets the caller wrap each call in a tracing span for its round. These classes are
synchronous (the coordinator drives each sequence's engine on its own thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import ContextManager, Protocol

import grpc
import torch

from services.engine.roles import FeatureKind
from services.engine.verifier import PrefillResult, VerifyResult
from services.rpc import codec
from services.rpc.channel import open_channel
from services.rpc.config import MESSAGE_OVERHEAD
from services.errors import SequenceNotFound
from services.rpc.errors import DownstreamError
from services.rpc.security import NONE, Security
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import drafter_grpc
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.logprobs import TokenLogprobs
from services.spec.overlap import RunAhead
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams

log = logging.getLogger("aerie.rpc")
RELEASE_TIMEOUT_S = 10.0


class Phases(Protocol):
    def phase(self, round_index: int, name: str) -> ContextManager:
        """Context for the `name` call of round `round_index`: 'draft', 'draft_ahead', 'verify', or the
        start of a run of rounds from it ('verify_run', 'decode_run': the stream's opening only)."""


class _NoPhases:
    def phase(self, round_index: int, name: str) -> ContextManager:
        return contextlib.nullcontext()


NO_PHASES = _NoPhases()


class ServiceClient:
    role = "service"

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, security: Security = NONE) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = max_message_bytes - MESSAGE_OVERHEAD
        self.channel = open_channel(address, max_message_bytes, security)
        self._info = None

    def call(self, method, request, timeout_s: float | None = None):
        """One unary call with a deadline; failures become DownstreamError."""
        try:
            return method(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise DownstreamError.from_rpc(e, self.role, self.address) from None

    def info(self, refresh: bool = False):
        if self._info is None or refresh:
            self._info = self.call(self.stub.GetInfo, pb.InfoRequest())
        return self._info

    def release(self, seq_id: str) -> None:
        """Best effort: release runs in the engine's `finally` and must not mask the real error.
        Its deadline is at least RELEASE_TIMEOUT_S, so a round that timed out still frees its KV."""
        try:
            self.call(self.stub.Release, pb.ReleaseRequest(sequence_id=seq_id),
                      max(self.timeout_s, RELEASE_TIMEOUT_S))
        except DownstreamError as e:
            log.warning("release of %s on %s %s failed: %s", seq_id, self.role, self.address, e)

    def close(self) -> None:
        self.channel.close()


class VerifierClient(ServiceClient):
    role = "verifier"

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, security: Security = NONE) -> None:
        super().__init__(address, max_message_bytes, timeout_s, security)
        self.stub = verifier_grpc.VerifierStub(self.channel)

    def for_sequence(self, feature_kind: FeatureKind, phases: Phases = NO_PHASES, client: str = "") -> RemoteVerifier:
        """`client`: the identity the sequence's KV counts against on the verifier ("" = anonymous)."""
        return RemoteVerifier(self, feature_kind, phases, client)


class DrafterClient(ServiceClient):
    role = "drafter"

    def __init__(self, address: str, max_message_bytes: int, timeout_s: float, security: Security = NONE) -> None:
        super().__init__(address, max_message_bytes, timeout_s, security)
        self.stub = drafter_grpc.DrafterStub(self.channel)

    def for_sequence(self, phases: Phases = NO_PHASES) -> RemoteDrafter:
        return RemoteDrafter(self, phases)


@dataclass(frozen=True, slots=True)
class NextDraft:
    """A Verify's next draft (VerifyRequest.next_draft): the drafter's idempotency index for it, the
    tree's shape (None: the drafter's largest) and the drafter's address ("": the verifier's own
    process, a verifier that drafts too; else the verifier sends it the Draft, --direct-drafts)."""
    index: int
    params: TreeParams | None
    drafter: str = ""

    def encode(self) -> vpb.NextDraft:
        msg = vpb.NextDraft(round_index=self.index, drafter=self.drafter)
        if self.params is not None:
            msg.tree.CopyFrom(codec.encode_tree_params(self.params))
        return msg


class RemoteVerifier:
    """The verifier role over gRPC (see services.engine.roles.VerifierRole)."""

    def __init__(self, client: VerifierClient, feature_kind: FeatureKind, phases: Phases, kv_client: str = "") -> None:
        self.client = client
        self.kv_client = kv_client  # sent as `aerie-client` metadata with Prefill: the verifier's KV shares
        self.feature_kind = feature_kind
        self.phases = phases
        info = client.info()
        self.vocab_size = int(info.vocab_size)
        self.prefill_chunk = int(info.prefill_chunk)  # rows per prefill call (0 = the whole prompt in one)
        self._kept = 0  # Decode calls since the last Verify that kept their row's features there
        self.busy = 0.0  # the drafter's load in the latest answer with a next tree (VerifyResponse.drafter_busy)
        self._logprobs: TokenLogprobs | None = None  # the latest call's (sampling.logprobs set)

    def take_logprobs(self, seq_id: str) -> TokenLogprobs | None:
        """The target's log-probabilities of the latest call's tokens (see Verifier.take_logprobs)."""
        out, self._logprobs = self._logprobs, None
        return out

    def prefill(self, seq_id: str, prompt: torch.Tensor, sampling: SamplingParams, capacity: int,
                rebuild: bool = False, offset: int = 0, prompt_tokens: int = 0,
                next_draft: NextDraft | None = None) -> PrefillResult:
        """`rebuild`: prompt + committed tokens of an admitted sequence (a fail-over), not bounded by
        the verifier's max_prompt_tokens. A chunk (coordinator/prefill.py): prompt [c] holds rows
        [offset, offset + c) of a `prompt_tokens`-row prompt (0 = `prompt` is all of it); its own
        deadline; first_token is -1 until the last chunk; features [c, F] of these rows only, and
        (sampling.prompt_logprobs) the log-probabilities of the prompt tokens these rows score.
        `next_draft` (on every chunk; verifier_svc/first_draft.py): round 1's tree drafted in the call
        (the last chunk's next_tree; `busy` the drafter's load); features [0, F] then, and a chunk
        before the last carries none; a draft that failed: the last chunk carries every row's."""
        more = bool(prompt_tokens) and offset + len(prompt) < prompt_tokens
        request = vpb.VerifierPrefillRequest(
            sequence_id=seq_id, prompt_ids=prompt.tolist(), sampling=codec.encode_sampling(sampling),
            capacity=capacity, feature_kind=codec.WIRE_FEATURE_KINDS[self.feature_kind], rebuild=rebuild,
            offset=offset, more=more, prompt_tokens=prompt_tokens)
        if next_draft is not None:
            request.next_draft.CopyFrom(next_draft.encode())
        rows = 0 if self.feature_kind == "none" else len(prompt)  # plain decoding gets no features
        features = codec.TensorAssembler("features", shape=(None if next_draft is not None else rows, None))
        first_token, prompt_logprobs, next_tree, next_draft_s = None, None, None, 0.0
        with self.phases.phase(0, "verify"):
            try:
                metadata = (("aerie-client", self.kv_client),) if self.kv_client else None
                for msg in self.client.stub.Prefill(request, timeout=self.client.timeout_s, metadata=metadata):
                    if first_token is None:
                        first_token = int(msg.first_token)
                        if msg.HasField("logprobs"):
                            self._logprobs = codec.decode_logprobs(msg.logprobs, [first_token])
                        if msg.HasField("prompt_logprobs"):
                            prompt_logprobs = codec.decode_logprobs(msg.prompt_logprobs, None)
                        if msg.HasField("next_tree"):
                            next_tree = codec.decode_tree(msg.next_tree, self.vocab_size)
                            next_draft_s, self.busy = msg.next_draft_seconds, msg.drafter_busy
                    features.add(msg.features)
            except grpc.RpcError as e:
                raise DownstreamError.from_rpc(e, self.client.role, self.client.address) from None
        result = features.result()
        if next_draft is not None and result.shape[0] not in (0, offset + len(prompt) if not more else 0):
            raise DownstreamError(grpc.StatusCode.INTERNAL, (
                f"verifier {self.client.address} answered a chunk at offset {offset} with next_draft with "
                f"{result.shape[0]} feature rows (expected 0, or {offset + len(prompt)} from the last chunk)"))
        return PrefillResult(first_token, result, prompt_logprobs, next_tree, next_draft_s)

    def verify(self, seq_id: str, tree: DraftTree, round_index: int,
               next_draft: NextDraft | None = None) -> VerifyResult:
        """`next_draft` (a verifier that drafts too, or one that reaches the sequence's drafter): the
        result's next_tree is drafted from the verdict in the same call (None when the verifier skipped
        it: rows kept by Decode calls, a drafter that failed); `busy` is then the drafter's load."""
        request = vpb.VerifyRequest(sequence_id=seq_id, round_index=round_index, tree=codec.encode_tree(tree))
        if next_draft is not None:
            request.next_draft.CopyFrom(next_draft.encode())
        with self.phases.phase(round_index, "verify"):
            response = self.client.call(self.client.stub.Verify, request)
        return self.result(response)

    def result(self, response: vpb.VerifyResponse) -> VerifyResult:
        """A Verify's (or a VerifyRun round's) answer: the verdict, the features (the rows Decode calls
        kept first), its logprobs (take_logprobs) and its next tree."""
        # with a next tree the verifier's head took the round's features: none come back (a run that
        # drafts ahead says which rows the drafter has not taken: pending_rows)
        with_features = self.feature_kind != "none" and not response.HasField("next_tree")
        result = codec.decode_verify_result(response, with_features, self._kept, any_rows=response.pending_rows)
        self._kept = 0
        if response.HasField("logprobs"):
            self._logprobs = codec.decode_logprobs(response.logprobs, result.acceptance.new_tokens)
        if response.verify_seconds > 0:
            result = replace(result, verify_s=response.verify_seconds)
        if response.pending_rows:
            result = replace(result, ahead_s=response.ahead_seconds, ahead_wait_s=response.ahead_wait_seconds,
                             next_ahead=response.next_tree_ahead, pending_rows=True,
                             draft_index=response.draft_index, ahead_failed=response.ahead_failed)
        if response.HasField("next_tree"):
            self.busy = response.drafter_busy
            result = replace(result, next_tree=codec.decode_tree(response.next_tree, self.vocab_size),
                             next_draft_s=response.next_draft_seconds, from_run=response.round_index > 0)
        return result

    def verify_run(self, seq_id: str, tree: DraftTree, round_index: int, next_draft: NextDraft,
                   rounds: int, max_tokens: int, stop_ids: frozenset[int], ahead: RunAhead | None = None) -> TreeRun:
        """A run of up to `rounds` tree rounds from `round_index` on a verifier that drafts too (the
        VerifyRun call; its stop rules: max_tokens, stop_ids; `ahead`: drafting ahead in its rounds, with
        the drafter in another process): read with TreeRun.next, close() cancels."""
        return TreeRun(self, seq_id, tree, round_index, next_draft, rounds, max_tokens, stop_ids, ahead)

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int:
        request = vpb.DecodeRequest(sequence_id=seq_id, round_index=round_index, token=token,
                                    keep_features=keep_features)
        with self.phases.phase(round_index, "verify"):
            response = self.client.call(self.client.stub.Decode, request)
        token = int(response.token)
        if response.HasField("logprobs"):
            self._logprobs = codec.decode_logprobs(response.logprobs, [token])
        if keep_features and self.feature_kind != "none":
            self._kept += 1
        return token

    def decode_run(self, seq_id: str, token: int, round_index: int, steps: int,
                   keep_features: bool = False) -> PlainRun:
        """A run of `steps` plain steps from round `round_index` (the DecodeRun call): an iterator of
        tokens, one per round, read as the engine needs them; close() cancels the rest. Each token's
        logprobs are what take_logprobs returns after it. The stream's deadline is timeout_s per step."""
        return PlainRun(self, seq_id, token, round_index, steps, keep_features)

    def release(self, seq_id: str) -> None:
        self.client.release(seq_id)


class _RunStream:
    """The answers of one run call (DecodeRun, VerifyRun), read one at a time. Each read has the
    deadline of a unary call (timeout_s, kept by a watchdog thread that cancels the call: a stuck
    verifier is found as soon as a unary call would find it); the stream's own deadline is timeout_s
    per step."""

    def __init__(self, rv: RemoteVerifier, seq_id: str, call) -> None:
        self.rv = rv
        self.seq_id = seq_id
        self._call = call
        self._ended = False  # the stream ended (the verifier ended the run)
        self._read = 0  # answers read from the stream
        self._cond = threading.Condition()
        self._deadline: float | None = None  # time.monotonic() by which the read in progress must answer
        self._timed_out = False
        self._done = False
        threading.Thread(target=self._watchdog, name="aerie-run-deadline", daemon=True).start()

    def _next_answer(self, round_index: int, unimplemented_ok: bool = True):
        """The next answer within timeout_s; None when the stream ended (`_ended`), or when the
        verifier does not have the call (UNIMPLEMENTED on the first read)."""
        rv = self.rv
        with self._cond:
            self._deadline = time.monotonic() + rv.client.timeout_s
            self._cond.notify()
        try:
            answer = next(self._call)
            self._read += 1
            return answer
        except StopIteration:
            self._ended = True
            return None
        except grpc.RpcError as e:
            if self._timed_out:
                raise DownstreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"{rv.client.role} at {rv.client.address} did not answer in time: round "
                                      f"{round_index} of a run took over {rv.client.timeout_s:g} s") from None
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and not self._read and unimplemented_ok:
                return None
            raise DownstreamError.from_rpc(e, rv.client.role, rv.client.address) from None
        finally:
            with self._cond:
                self._deadline = None

    def _watchdog(self) -> None:
        with self._cond:
            while not self._done:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._timed_out = True
                    self._call.cancel()
                    return
                self._cond.wait(left)

    def close(self) -> None:
        """Cancel the rest of the run (the verifier stops after the step in progress)."""
        self._call.cancel()
        self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()


class PlainRun(_RunStream):
    """The tokens of one DecodeRun call (RemoteVerifier.decode_run), one per round. A failed read
    raises DownstreamError (tokens read before stay valid); deadlines as _RunStream's. A verifier
    without DecodeRun (UNIMPLEMENTED on the first read) is asked with one Decode per remaining round
    instead."""

    def __init__(self, rv: RemoteVerifier, seq_id: str, token: int, round_index: int, steps: int,
                 keep_features: bool) -> None:
        request = vpb.DecodeRunRequest(sequence_id=seq_id, round_index=round_index, token=token, steps=steps,
                                       keep_features=keep_features)
        with rv.phases.phase(round_index, "decode_run"):  # (its traceparent: the call's server span joins the trace)
            call = rv.client.stub.DecodeRun(request, timeout=rv.client.timeout_s * steps)
        super().__init__(rv, seq_id, call)
        self.keep_features = keep_features
        self.round_index = round_index  # the round of the next token
        self.left = steps  # tokens not read yet
        self._token = token  # the latest token (the next step's input)
        self._unary = False  # the verifier has no DecodeRun: one Decode per round

    def __iter__(self) -> PlainRun:
        return self

    def __next__(self) -> int:
        if self.left <= 0:
            raise StopIteration
        rv, round_index = self.rv, self.round_index
        if self._unary:
            token = rv.decode(self.seq_id, self._token, round_index, self.keep_features)
        else:
            with rv.phases.phase(round_index, "verify"):
                response = self._next_answer(round_index)
            if response is None and self._ended:
                raise DownstreamError(grpc.StatusCode.INTERNAL, f"verifier {rv.client.address} ended a run of "
                                      f"{self.seq_id!r} {self.left} steps early")
            if response is None:  # UNIMPLEMENTED: an older verifier
                self._unary = True
                return next(self)
            token = int(response.token)
            rv._logprobs = codec.decode_logprobs(response.logprobs, [token]) if response.HasField("logprobs") else None
            if self.keep_features and rv.feature_kind != "none":
                rv._kept += 1
        self._token, self.round_index, self.left = token, round_index + 1, self.left - 1
        if not self.left:
            self._stop_watchdog()
        return token

    def close(self) -> None:
        self.left = 0
        super().close()


class TreeRun(_RunStream):
    """The rounds of one VerifyRun call (RemoteVerifier.verify_run), one VerifyResult a round, each
    with its next tree (`next_tree`, which the next round verifies). `next(round_index)` reads that
    round's answer; None: the verifier ended the run before it (its stop rules). A failed read raises
    DownstreamError (rounds read before stay valid); deadlines as _RunStream's."""

    def __init__(self, rv: RemoteVerifier, seq_id: str, tree: DraftTree, round_index: int,
                 next_draft: NextDraft, rounds: int, max_tokens: int, stop_ids: frozenset[int],
                 ahead: RunAhead | None = None) -> None:
        request = vpb.VerifyRunRequest(sequence_id=seq_id, round_index=round_index, tree=codec.encode_tree(tree),
                                       rounds=rounds, max_tokens=max_tokens, stop_ids=sorted(stop_ids),
                                       next_draft=next_draft.encode())
        if ahead is not None:
            request.ahead.CopyFrom(vpb.RunAhead(depth=ahead.depth, max_guess=ahead.max_guess,
                                                branches=ahead.branches, sort_paths=ahead.sort_paths))
        self.ahead = ahead
        self.max_tokens, self.stop_ids = max_tokens, stop_ids
        self._made, self._stopped = 0, False  # tokens its rounds committed; a round committed a stop id
        with rv.phases.phase(round_index, "verify_run"):  # (its traceparent: the call's server span joins the trace)
            call = rv.client.stub.VerifyRun(request, timeout=rv.client.timeout_s * rounds)
        super().__init__(rv, seq_id, call)
        self.rounds = rounds
        self.round_index = round_index  # the round of the next answer
        self.next_index = next_draft.index  # the Drafter index of the next answer's draft
        self.drafter = next_draft.drafter  # where the verifier drafts ("": in its own process)

    @property
    def exhausted(self) -> bool:
        """Every round it asked for was read, or its stop rules ended it (the verifier ends it there)."""
        return self._read >= self.rounds or self._made >= self.max_tokens or self._stopped

    @property
    def finished(self) -> bool:
        """The verifier ended it (every round read, or its stop rules): it sends the drafter nothing more."""
        return self._ended or self.exhausted

    def next(self, round_index: int) -> VerifyResult | None:
        rv = self.rv
        if self._ended or round_index != self.round_index:
            return None
        with rv.phases.phase(round_index, "verify"):
            response = self._next_answer(round_index, unimplemented_ok=False)
        if response is None:
            self._stop_watchdog()
            return None
        if response.round_index != round_index:
            raise DownstreamError(grpc.StatusCode.INTERNAL, f"verifier {rv.client.address} answered round "
                                  f"{response.round_index} of {self.seq_id!r}'s run where {round_index} was due")
        result = rv.result(response)
        new = result.acceptance.new_tokens
        self._made += len(new)
        self._stopped = self._stopped or bool(self.stop_ids.intersection(new))
        self.round_index += 1
        self.next_index = response.draft_index + 1 if response.pending_rows else self.next_index + 1
        return result


class RemoteDrafter:
    """The drafter role over gRPC (see services.engine.roles.DrafterRole). `start` only records the
    parameters: the first `draft` sends them with the prompt features in one streamed Prefill."""

    def __init__(self, client: DrafterClient, phases: Phases) -> None:
        self.client = client
        self.phases = phases
        info = client.info()
        self.tree: TreeParams = codec.decode_tree_params(info.tree)
        self.vocab_size = int(info.vocab_size)
        self._feature_kind = codec.FEATURE_KINDS[info.feature_kind]
        self._pending: dict[str, tuple[int, bool, int]] = {}  # started, not yet prefilled: (max_rows, sampling, index)
        self._round: dict[str, int] = {}  # the round the latest tree is for
        self._elsewhere: set[str] = set()  # a verifier was asked to send the sequence's Prefill here
        self.busy = 0.0  # the drafter's load in its latest answer (DraftResponse.busy, 0..1)

    @property
    def feature_kind(self) -> FeatureKind:
        return self._feature_kind

    def start(self, seq_id: str, max_rows: int, sampling: bool, first_index: int = 1) -> None:
        """`first_index`: the Prefill's Drafter index (a rebuild numbers past calls still in flight)."""
        self._pending[seq_id] = (max_rows, sampling, first_index)

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None, span_round: int | None = None,
              first_row: int | None = None) -> DraftTree:
        """`params`: this round's shape (None = the drafter's largest). The round index sent is the
        count of draft calls (the drafter's idempotency key), not the engine's round; `span_round`:
        the engine's round that verifies the tree, for the tracing span (None: that count);
        `first_row`: the draft KV row tokens[0] goes to (DraftRequest.first_row; a Prefill ignores it)."""
        if seq_id in self._pending:
            max_rows, sampling, round_index = self._pending.pop(seq_id)
            self._round[seq_id] = 0  # prefilled (or partly): release must reach the drafter
            with self.phases.phase(span_round or round_index, "draft"):
                response = self.client.call(self.client.stub.Prefill, codec.drafter_prefill(
                    seq_id, max_rows, sampling, tokens, features, params, round_index, self.client.chunk_bytes))
        else:
            round_index = self._round.get(seq_id, 0) + 1
            request = dpb.DraftRequest(sequence_id=seq_id, round_index=round_index, tokens=tokens.tolist(),
                                       features=codec.encode_tensor(features))
            if params is not None:
                request.tree.CopyFrom(codec.encode_tree_params(params))
            if first_row is not None:
                request.first_row = first_row
            with self.phases.phase(span_round or round_index, "draft"):
                response = self.client.call(self.client.stub.Draft, request)
        self._round[seq_id] = round_index
        self.busy = response.busy
        return codec.decode_tree(response.tree, self.vocab_size)

    def draft_ahead(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor, guess: list[int],
                    params: TreeParams | None = None, span_round: int | None = None, branches: int | None = None,
                    exclude: tuple[tuple[int, ...], ...] = (), chain: tuple[int, ...] = ()) -> DraftTree | None:
        """The DraftAhead call (services.engine.drafter.Drafter.draft_ahead over gRPC): tokens [n] /
        features [n, F] committed rows the draft KV has not seen (n may be 0), `guess` the guessed
        committed tokens -> the ahead tree rooted at guess[-1], or None (the guessed rows do not fit).
        `branches` / `exclude` / `chain`: the ahead tree's likely bonuses (services/spec/ahead_tree.py).
        Numbered with the draft calls (the drafter's idempotency key); `span_round` as in `draft`.
        Runs on the engine's drafter thread while the main thread's Verify is in flight (one call of
        a sequence at a time)."""
        if not self.prefilled(seq_id):
            raise SequenceNotFound(f"sequence {seq_id!r} has no draft KV on drafter {self.client.address} yet: "
                                   "draft before drafting ahead")
        round_index = self._round.get(seq_id, 0) + 1
        request = dpb.DraftAheadRequest(sequence_id=seq_id, round_index=round_index, tokens=tokens.tolist(),
                                        guess=list(guess), chain=list(chain), exclude=[t for e in exclude for t in e],
                                        exclude_sizes=[len(e) for e in exclude])
        if branches is not None:
            request.branches = branches
        if tokens.numel():
            request.features.CopyFrom(codec.encode_tensor(features))
        if params is not None:
            request.tree.CopyFrom(codec.encode_tree_params(params))
        with self.phases.phase(span_round or round_index, "draft_ahead"):
            response = self.client.call(self.client.stub.DraftAhead, request)
        self._round[seq_id] = round_index
        self.busy = response.busy
        return codec.decode_tree(response.tree, self.vocab_size) if response.HasField("tree") else None

    def next_index(self, seq_id: str) -> int:
        """The idempotency index of the sequence's next draft call (its first after the Prefill: 2)."""
        return self._round.get(seq_id, 0) + 1

    def skip_index(self, seq_id: str) -> None:
        """Number the next call one past its index: a call another process sent at that index may still
        reach the drafter (a run's DraftAhead), which then refuses it as older than ours."""
        self._round[seq_id] = self.next_index(seq_id)

    def prefilling_elsewhere(self, seq_id: str) -> None:
        """A verifier was asked to send this drafter the sequence's Prefill (round 1's tree in its own
        Prefill): whether or not an answer says it ran, `release` must reach the drafter."""
        self._elsewhere.add(seq_id)

    def drafted_elsewhere(self, seq_id: str, round_index: int, busy: float) -> None:
        """A draft at `round_index` ran inside a Verify, or the drafter's Prefill inside the verifier's
        (its `start` is then done: nothing pending)."""
        self._pending.pop(seq_id, None)
        self._round[seq_id] = round_index
        self.busy = busy

    def prefilled(self, seq_id: str) -> bool:
        """The drafter holds the sequence's draft KV (its first draft, the streamed Prefill, was sent)."""
        return seq_id in self._round

    def release(self, seq_id: str) -> None:
        self._pending.pop(seq_id, None)
        elsewhere = seq_id in self._elsewhere
        self._elsewhere.discard(seq_id)
        if self._round.pop(seq_id, None) is not None or elsewhere:
            self.client.release(seq_id)
