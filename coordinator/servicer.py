"""CoordinatorServicer: decode -> admit / cancel / read -> encode. Nothing else lives here.

Generate streams what the sequence's run commits: each message is sent only after its round is in
Redis. When the client goes away (or the stream fails) the run is cancelled and stops after the
round in flight, releasing the KV on both services.
"""

from __future__ import annotations

import asyncio

import grpc

from services import telemetry
from services.rpc import codec
from services.errors import InvalidRequest
from services.rpc.errors import DownstreamError, rpc_errors
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from coordinator.config import CoordinatorConfig
from coordinator.sequence_run import Committed
from coordinator.sequence_store import SequenceStore
from coordinator.sequences import Sequences

RESUME_POLL_S = 0.02  # Resume follows Redis at this interval (backing off to 0.25 s while idle)
STATUS = {"running": cpb.SEQUENCE_STATUS_RUNNING, "finished": cpb.SEQUENCE_STATUS_FINISHED,
          "cancelled": cpb.SEQUENCE_STATUS_CANCELLED, "failed": cpb.SEQUENCE_STATUS_FAILED}


class CoordinatorServicer(coordinator_grpc.CoordinatorServicer):
    SERVICE = "coordinator"

    def __init__(self, config: CoordinatorConfig, sequences: Sequences, store: SequenceStore) -> None:
        self.config = config
        self.sequences = sequences
        self.store = store

    @rpc_errors
    async def Generate(self, request: cpb.GenerateRequest, context):
        req = codec.decode_generation_request(request, self.config.max_new_tokens)
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
        try:
            admitted = await asyncio.to_thread(self.sequences.admit, req, seq_id, emit, span)
            if span is not None:
                span.set_attribute(telemetry.SEQ_ID, admitted.run.seq_id)
            first = True
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                step = item.step
                produced += len(step.tokens)
                finished = step.finish_reason is not None
                response = cpb.GenerateResponse(sequence_id=admitted.run.seq_id, tokens=step.tokens,
                                                stats=codec.encode_stats(step.stats, item.commit_s),
                                                finish_reason=step.finish_reason or "")
                if first:
                    response.info.CopyFrom(admitted.info)
                    first = False
                yield response
            if span is not None:
                span.set_attributes({telemetry.OUTPUT_TOKENS: produced, telemetry.FINISH_REASON: [step.finish_reason]})
        except Exception as e:
            telemetry.record_error(span, e)
            raise
        finally:
            if admitted is not None and not finished:
                admitted.run.cancel()  # the client went away or the stream failed
            if span is not None:
                span.end()

    @rpc_errors
    async def Cancel(self, request: cpb.CancelRequest, context) -> cpb.CancelResponse:
        status = await asyncio.to_thread(self.sequences.cancel, codec.sequence_id(request.sequence_id))
        return cpb.CancelResponse(status=STATUS[status])

    @rpc_errors
    async def GetInfo(self, request, context) -> cpb.CoordinatorInfo:
        return await asyncio.to_thread(self.sequences.info)

    @rpc_errors
    async def GetSequence(self, request: cpb.GetSequenceRequest, context) -> cpb.Sequence:
        s = await asyncio.to_thread(self.store.get, codec.sequence_id(request.sequence_id))
        return cpb.Sequence(sequence_id=s.sequence_id, prompt_ids=s.prompt_ids, tokens=s.tokens,
                            status=STATUS[s.status], finish_reason=s.finish_reason, round=s.round,
                            placement=cpb.Placement(drafter=s.drafter, verifier=s.verifier), error=s.error)

    @rpc_errors
    async def Resume(self, request: cpb.ResumeRequest, context):
        """Committed tokens from `from_token_index` on, then each new commit until the sequence ends
        (it reads Redis, so any coordinator answers, whichever one drives the sequence)."""
        seq_id = codec.sequence_id(request.sequence_id)
        sent = request.from_token_index
        if sent < 0:
            raise InvalidRequest(f"from_token_index must be >= 0; got {sent}")
        poll_s = RESUME_POLL_S
        while True:
            tokens, status, reason, round_index, error, total = await asyncio.to_thread(self.store.tail, seq_id, sent)
            if sent > total:
                raise InvalidRequest(f"from_token_index {sent} is beyond the committed tokens of {seq_id!r}")
            final = status != "running"
            if status == "failed":
                if tokens:
                    yield cpb.GenerateResponse(sequence_id=seq_id, tokens=tokens, stats=cpb.RoundStats(index=round_index))
                raise DownstreamError(grpc.StatusCode.ABORTED, f"sequence {seq_id!r} failed: {error}")
            if tokens or final:
                sent += len(tokens)
                yield cpb.GenerateResponse(sequence_id=seq_id, tokens=tokens, stats=cpb.RoundStats(index=round_index),
                                           finish_reason=("cancel" if status == "cancelled" else reason) if final else "")
                poll_s = RESUME_POLL_S
            if final:
                return
            await asyncio.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.25)
