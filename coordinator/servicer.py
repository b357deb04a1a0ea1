"""CoordinatorServicer: decode -> admit / cancel / read -> encode. Nothing else lives here.

Generate streams what the sequence's run commits: each message is sent only after its round is in
Redis. When the client goes away (or the stream fails) the run is cancelled and stops after the
round in flight, releasing the KV on both services. Text (prompts, chat messages, stop strings, text
deltas) is coordinator/text.py; the vLLM-style request metrics are coordinator/request_metrics.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from pathlib import PurePath

import grpc

from services import telemetry
from services.rpc import codec
from services.errors import CapacityExceeded, InvalidRequest, SequenceNotFound
from services.rpc.errors import RETRY_AFTER
from services.rpc.forwarded import TrustedProxies
from services.rpc.security import ANONYMOUS, NONE, Security, bearer, token_identity
from services.rpc.errors import DownstreamError, rpc_errors
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from coordinator.admission import AdmissionQueue
from coordinator.rate_limit import RateLimited, RateLimits
from coordinator.config import CoordinatorConfig
from coordinator.sequence_run import Committed, HandedOver
from coordinator.sequence_store import SequenceStore
from coordinator.stored_logprobs import from_rows
from coordinator.sequences import Sequences
from coordinator.request_metrics import RequestMetrics
from coordinator.generation_defaults import generation_defaults
from coordinator.text import Text, served_name

RESUME_POLL_S = 0.02  # Resume follows Redis at this interval (backing off to 0.25 s while idle)
STATUS = {"running": cpb.SEQUENCE_STATUS_RUNNING, "finished": cpb.SEQUENCE_STATUS_FINISHED,
          "cancelled": cpb.SEQUENCE_STATUS_CANCELLED, "failed": cpb.SEQUENCE_STATUS_FAILED}


class CoordinatorServicer(coordinator_grpc.CoordinatorServicer):
    SERVICE = "coordinator"

    def __init__(self, config: CoordinatorConfig, sequences: Sequences, store: SequenceStore,
                 security: Security = NONE) -> None:
        self.config = config
        self.sequences = sequences
        self.store = store
        self.security = security
        self._per_client: dict[str, int] = {}  # open Generate streams per client (identity or peer host)
        self._proxies = TrustedProxies.parse(config.trusted_proxies)
        self._rate = RateLimits(config.rate_limit_rps, config.rate_limit_burst)  # per client key
        self._text: Text | None = None
        self._text_lock = threading.Lock()
        self._target = ""  # the verifier's target, once one has answered
        # past --max-sequences a request waits for a slot, in turns across clients (coordinator/admission.py)
        self.admission = AdmissionQueue(sequences.try_reserve, sequences.release_reserved, config.max_queued_requests,
                                        config.queue_timeout_s, config.max_sequences)
        sequences.on_free = self.admission.wake_threadsafe
        sequences.text_engine = lambda p, primer: self.text().stop_engine_for(p.stop, p.skip_special_tokens, primer)

    def text(self) -> Text:
        """The target's tokenizer, loaded once (blocking: run it off the event loop). Without
        --tokenizer it is the target a verifier serves, so the first call needs a verifier."""
        with self._text_lock:
            if not self._target:
                try:
                    self._verifier_target()
                except DownstreamError as e:
                    if self.config.tokenizer is None:  # not cached: token-id requests go on to admission
                        return Text(None, "", unavailable=str(e))
            if self._text is None:
                self._text = Text.load(self.config.tokenizer or self._target)
            return self._text

    def _verifier_target(self) -> str:
        for client in self.sequences.verifiers.clients():
            try:
                self._target = client.info().target
                return self._target
            except DownstreamError:
                continue
        raise DownstreamError(grpc.StatusCode.UNAVAILABLE, "no verifier answers: the coordinator cannot name "
                                                           "the target or load its tokenizer yet")

    # ---- identity (docs/security.md) -----------------------------------------------------------------

    def identity(self, context) -> str:
        """The caller's identity: its API token's (the ServerAuth interceptor already refused unknown
        ones), or ANONYMOUS when the coordinator has no API tokens (sequences are then shared)."""
        if not self.security.api_tokens:
            return ANONYMOUS
        found = token_identity(bearer(context.invocation_metadata()), self.security.api_tokens)
        return found or ANONYMOUS

    def _client_key(self, identity: str, context) -> str:
        """Who the per-client limits count: the identity, else the peer's host (or the HTTP caller's)."""
        if self.security.api_tokens:
            return f"identity {identity}"
        # the HTTP gateway names its caller (from a trusted proxy only: services/rpc/forwarded.py)
        return f"peer {self._proxies.client_host(context.peer() or '', context.invocation_metadata())}"

    def _check_rate(self, key: str, context) -> None:
        """RateLimited (RESOURCE_EXHAUSTED, `retry-after` seconds in the trailing metadata) for a client
        over its request rate (coordinator/rate_limit.py)."""
        try:
            self._rate.check(key)
        except RateLimited as e:
            context.set_trailing_metadata(((RETRY_AFTER, f"{e.retry_after_s:.3f}"),))
            raise

    def _take_slot(self, key: str) -> None:
        limit = self.config.max_sequences_per_client
        held = self._per_client.get(key, 0)
        if limit and held >= limit:
            raise CapacityExceeded(f"{key} already has {held} sequences open on this coordinator, its limit "
                                   f"(AERIE_MAX_SEQUENCES_PER_CLIENT={limit})")
        self._per_client[key] = held + 1

    def _give_slot(self, key: str) -> None:
        held = self._per_client.get(key, 0) - 1
        if held > 0:
            self._per_client[key] = held
        else:
            self._per_client.pop(key, None)

    def _check_owner(self, seq_id: str, identity: str) -> None:
        """Another identity's sequence is NOT_FOUND, exactly as an unknown one: a caller learns nothing
        about sequences it did not create (not even that the id exists)."""
        if self.store.client_of(seq_id) != identity:
            raise SequenceNotFound(f"unknown sequence {seq_id!r}")

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or served_name(self._target or self.config.tokenizer or "unknown")

    @rpc_errors
    async def Generate(self, request: cpb.GenerateRequest, context):
        identity = self.identity(context)
        key = self._client_key(identity, context)
        self._check_rate(key, context)
        self._take_slot(key)  # before any work: a client over its limit costs nothing
        try:
            async for response in self._generate(request, context, identity, key):
                yield response
        finally:
            self._give_slot(key)

    async def _generate(self, request: cpb.GenerateRequest, context, identity: str, key: str = ""):
        text = await asyncio.to_thread(self.text)
        prompt_ids = text.prompt_ids(request)
        stream = text.stream(request)  # validates the stop strings
        req = dataclasses.replace(codec.decode_generation_request(request, self.config.max_new_tokens),
                                  prompt_ids=tuple(prompt_ids))
        seq_id = codec.sequence_id(request.sequence_id) if request.sequence_id else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Committed | BaseException] = asyncio.Queue()

        def emit(item: Committed | BaseException) -> None:  # called on the run's thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, item)

        span = telemetry.begin_span("generate", parent=telemetry.current_context(), kind="server",
                                    attributes={telemetry.PROMPT_TOKENS: len(req.prompt_ids)})
        admitted = None
        finished = False
        produced = 0
        request_metrics = RequestMetrics(self.model_name)
        try:
            await self.admission.enter(key)  # waits (counted as waiting) while every slot is taken: in turns per client
            admitted = await asyncio.to_thread(self.sequences.admit, req, seq_id, emit, span,
                                               text.stop_engine(request), text.params(request), identity, key,
                                               reserved=True, fit_context=not request.HasField("max_new_tokens"))
            request_metrics.admitted(len(req.prompt_ids))
            if span is not None:
                span.set_attribute(telemetry.SEQ_ID, admitted.run.seq_id)
            first = True
            while not finished:
                item = await queue.get()
                if isinstance(item, HandedOver):  # draining: every committed token was streamed above
                    raise _handed_over(context, admitted.run.seq_id, produced, item)
                if isinstance(item, BaseException):
                    raise item
                output = item.output
                produced += len(output.tokens)
                finished = output.finish_reason is not None
                delta, _ = stream.push(output.tokens)
                if finished:
                    delta += stream.finish()
                request_metrics.round(output.stats, len(output.tokens))
                response = cpb.GenerateResponse(sequence_id=admitted.run.seq_id, tokens=output.tokens,
                                                stats=codec.encode_stats(output.stats, item.commit_s),
                                                finish_reason=output.finish_reason or "", text=delta,
                                                logprobs=text.logprobs(output.logprobs),
                                                prompt_logprobs=text.logprobs(output.prompt_logprobs))
                if first:
                    response.info.CopyFrom(admitted.info)
                    response.info.target, response.info.draft = public_name(response.info.target), \
                        public_name(response.info.draft)
                    response.info.prompt_tokens = len(req.prompt_ids)
                    first = False
                yield response
            request_metrics.finished(output.finish_reason)
            if span is not None:
                span.set_attributes({telemetry.OUTPUT_TOKENS: produced, telemetry.FINISH_REASON: [output.finish_reason]})
        except Exception as e:
            telemetry.record_error(span, e)
            raise
        finally:
            request_metrics.close()
            if admitted is not None and not finished:
                admitted.run.cancel()  # the client went away or the stream failed
            if span is not None:
                span.end()

    @rpc_errors
    async def Cancel(self, request: cpb.CancelRequest, context) -> cpb.CancelResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        await asyncio.to_thread(self._check_owner, seq_id, self.identity(context))
        status = await asyncio.to_thread(self.sequences.cancel, seq_id)
        return cpb.CancelResponse(status=STATUS[status])

    @rpc_errors
    async def GetSequence(self, request: cpb.GetSequenceRequest, context) -> cpb.Sequence:
        seq_id = codec.sequence_id(request.sequence_id)
        await asyncio.to_thread(self._check_owner, seq_id, self.identity(context))
        s = await asyncio.to_thread(self.store.get, seq_id)
        return cpb.Sequence(sequence_id=s.sequence_id, prompt_ids=s.prompt_ids, tokens=s.tokens,
                            status=STATUS[s.status], finish_reason=s.finish_reason, round_index=s.round_index,
                            round=s.round_index,  # (deprecated copy)
                            placement=cpb.Placement(drafter=s.drafter, verifier=s.verifier), error=s.error)

    @rpc_errors
    async def Resume(self, request: cpb.ResumeRequest, context):
        """Committed tokens from `from_token_index` on, then each new commit until the sequence ends
        (it reads Redis, so any coordinator answers, whichever one drives the sequence), with their
        log-probabilities when the sequence asked for them (stored with the tokens). The prompt's
        log-probabilities (sampling.prompt_logprobs) came with the Generate stream's first message
        only: they are not stored, and a Resume (even from token 0) does not send them."""
        seq_id = codec.sequence_id(request.sequence_id)
        sent = request.from_token_index
        if sent < 0:
            raise InvalidRequest(f"from_token_index must be >= 0; got {sent}")
        await asyncio.to_thread(self._check_owner, seq_id, self.identity(context))
        state = await asyncio.to_thread(self.store.get, seq_id)
        if sent > len(state.tokens):
            raise InvalidRequest(f"from_token_index {sent} is beyond the committed tokens of {seq_id!r}")
        # the same text deltas as the Generate stream: the detokenizer replays the tokens before `sent`
        params = state.params
        text = await asyncio.to_thread(self.text)
        stream = text.stream_for(params.stop if params else (), params.skip_special_tokens if params else True)
        stream.push(state.tokens[:sent])
        poll_s = RESUME_POLL_S
        while True:
            tail = await asyncio.to_thread(self.store.tail, seq_id, sent)
            tokens, status, reason, round_index, error = tail.tokens, tail.status, tail.finish_reason, tail.round_index, tail.error
            final = status != "running"
            logprobs = text.logprobs(from_rows(tokens, tail.logprobs)) if tokens and tail.logprobs else None
            if status == "failed":
                if tokens:
                    yield cpb.GenerateResponse(sequence_id=seq_id, tokens=tokens, stats=codec.round_only_stats(round_index),
                                               text=stream.push(tokens)[0], logprobs=logprobs)
                raise DownstreamError(grpc.StatusCode.ABORTED, f"sequence {seq_id!r} failed: {error}")
            if tokens or final:
                sent += len(tokens)
                delta, _ = stream.push(tokens)
                if final:
                    delta += stream.finish()
                yield cpb.GenerateResponse(sequence_id=seq_id, tokens=tokens, stats=codec.round_only_stats(round_index),
                                           finish_reason=("cancel" if status == "cancelled" else reason) if final else "",
                                           text=delta, logprobs=logprobs)
                poll_s = RESUME_POLL_S
            if final:
                return
            if self.sequences.draining.is_set():
                raise _handed_over(context, seq_id, sent, "this coordinator is draining")
            await asyncio.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.25)

    @rpc_errors
    async def Tokenize(self, request: cpb.TokenizeRequest, context) -> cpb.TokenizeResponse:
        text = await asyncio.to_thread(self.text)
        return await asyncio.to_thread(text.tokenize, request)

    @rpc_errors
    async def Detokenize(self, request: cpb.DetokenizeRequest, context) -> cpb.DetokenizeResponse:
        text = await asyncio.to_thread(self.text)
        return await asyncio.to_thread(text.detokenize, request, await asyncio.to_thread(self._vocab_size))

    def _vocab_size(self) -> int:
        verifiers = _answering(self.sequences.verifiers)
        if not verifiers:
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE, "no verifier answers: the vocabulary size is unknown")
        return int(verifiers[0].vocab_size)

    @rpc_errors
    async def GetInfo(self, request: pb.InfoRequest, context) -> cpb.CoordinatorInfo:
        return await asyncio.to_thread(self._info)

    def _info(self) -> cpb.CoordinatorInfo:
        """Asks every verifier and drafter now (a short deadline each), so it doubles as readiness;
        UNAVAILABLE when no verifier answers (a drafter that does not answer is counted, not fatal)."""
        verifiers = _answering(self.sequences.verifiers)
        if not verifiers:
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"no verifier available: none of {list(self.config.verifiers)} answers")
        drafters = _answering(self.sequences.drafters) if self.sequences.drafters else []
        v = verifiers[0]
        self._target = v.target
        text = self.text()
        info = cpb.CoordinatorInfo(target=public_name(v.target), dtype=v.dtype, vocab_size=v.vocab_size, model=self.model_name,
                                   max_context=v.max_context, text=text.tokenizer is not None,
                                   chat_template=text.has_chat_template, max_new_tokens=self.config.max_new_tokens,
                                   verifiers_ready=len(verifiers), drafters_ready=len(drafters),
                                   drafters_configured=len(self.config.drafters),
                                   generation_defaults=generation_defaults(text.source),
                                   model_aliases=self.config.model_aliases)
        if drafters:
            info.draft = public_name(drafters[0].draft)
            info.tree.CopyFrom(drafters[0].tree)
        return info


def _handed_over(context, seq_id: str, sent: int, why) -> DownstreamError:
    """The end of a stream on a draining coordinator: UNAVAILABLE, naming where to continue (also in
    the trailing metadata `aerie-resume-from`: the number of tokens this stream delivered in all)."""
    context.set_trailing_metadata((("aerie-resume-from", str(sent)),))
    return DownstreamError(grpc.StatusCode.UNAVAILABLE,
                           f"coordinator draining: {why}; Resume(sequence_id={seq_id!r}, from_token_index={sent}) "
                           f"on another coordinator")


def public_name(path: str) -> str:
    """A model's name without the directories it lives in: no filesystem path leaves the coordinator
    (clients compare targets by this name, services/rpc/coordinator_client.same_model)."""
    return PurePath(path).name if path else path


def _answering(pool, timeout_s: float = 2.0) -> list:
    """The GetInfo answers of the pool's replicas that answer within `timeout_s`."""
    out = []
    for client in pool.clients():
        try:
            out.append(client.call(client.stub.GetInfo, pb.InfoRequest(), timeout_s))
        except DownstreamError:
            continue
    return out
