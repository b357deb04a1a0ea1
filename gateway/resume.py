"""One HTTP request's token stream that outlives the coordinator it started on.

    call = ResumingCall(stubs, request, metadata, resume_s)   # Coordinator.Generate on stubs[0]
    msg = await call.read()                                    # a GenerateResponse, or grpc.aio.EOF
    call.cancel()                                              # the HTTP client went away

The request gets a sequence id chosen here (128 random bits, unless the request names one), so it
can be found again whatever happens:

    UNAVAILABLE before the first message  -> Generate with the same id on each other coordinator once
                                             (ALREADY_EXISTS there: the failed one had admitted it ->
                                             Resume from token 0 instead)
    UNAVAILABLE after it                  -> Resume(id, from_token_index = the tokens already read) on
                                             the coordinators in turn (the next one first), for up to
                                             `resume_s` (0: never, the error reaches the caller)

Every coordinator reads the sequence from Redis, and the one that takes it over (after the dead
one's lease, or at once after a drain) drives it, so the caller gets exactly the tokens (and text
deltas) it has not seen, as gRPC clients do (services/rpc/coordinator_client.py). It does not parse
HTTP or know OpenAI's shapes (gateway/app.py does).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc

from services.rpc.stubs import coordinator as cpb

log = logging.getLogger("aerie.http")
RETRY_PAUSE_S = 0.2  # between two rounds over every coordinator


class ResumingCall:
    def __init__(self, stubs: list, request: cpb.GenerateRequest, metadata, resume_s: float) -> None:
        """`stubs`: a CoordinatorStub per coordinator (the first one gets the Generate call)."""
        self.stubs = stubs
        self.metadata = metadata
        self.resume_s = resume_s
        self.request = cpb.GenerateRequest()
        self.request.CopyFrom(request)
        if not self.request.sequence_id:
            self.request.sequence_id = secrets.token_hex(16)
        self.sequence_id = self.request.sequence_id
        self.call = stubs[0].Generate(self.request, metadata=metadata)
        self.index = 0  # the stub the current call is on
        self.started = False  # a first message was read
        self._generations = 1  # Generate calls sent (before the first message: one per coordinator)
        self.received = 0  # tokens read so far
        self.resumes = 0
        self._cancelled = False
        self._done = False  # the stream ended (EOF)
        self._broken_at: float | None = None  # when the current outage began

    async def read(self):
        while True:
            try:
                msg = await self.call.read()
            except grpc.aio.AioRpcError as e:
                if self._cancelled:
                    raise
                if not self.started and e.code() == grpc.StatusCode.ALREADY_EXISTS and self._generations > 1:
                    self._open(self.index, "Resume", cpb.ResumeRequest(sequence_id=self.sequence_id))
                    continue
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if not self.started:
                    self._generate_elsewhere(e)
                else:
                    self._resume(e)
                continue
            if msg is grpc.aio.EOF:
                self._done = True
            else:
                self.started = True
                self.received += len(msg.tokens)
                self._broken_at = None
            return msg

    def _generate_elsewhere(self, error: grpc.aio.AioRpcError) -> None:
        """The same Generate (same id) on the next coordinator, each one once; then `error`."""
        if self._generations >= len(self.stubs):
            raise error
        log.warning("sequence %s: its coordinator is unavailable (%s); sending it to another one",
                    self.sequence_id, error.details())
        self._generations += 1
        self._open((self.index + 1) % len(self.stubs), "Generate", self.request)

    def _open(self, index: int, method: str, request, delay_s: float = 0.0) -> None:
        self.index = index
        self.call = _after(delay_s, getattr(self.stubs[index], method), request, self.metadata)

    def _resume(self, error: grpc.aio.AioRpcError) -> None:
        """Open a Resume call on the next coordinator (the failed one last), or re-raise `error` once
        the outage has lasted `resume_s`."""
        if self.resume_s <= 0:
            raise error
        now = time.monotonic()
        if self._broken_at is None:
            self._broken_at = now
            log.warning("sequence %s: its stream broke after %d tokens (%s); resuming on another coordinator",
                        self.sequence_id, self.received, error.details())
        elif now - self._broken_at > self.resume_s:
            raise error
        self.resumes += 1
        index = (self.index + 1) % len(self.stubs)
        self._open(index, "Resume", cpb.ResumeRequest(sequence_id=self.sequence_id, from_token_index=self.received),
                   RETRY_PAUSE_S if self.resumes > len(self.stubs) - 1 else 0.0)

    def cancel(self) -> None:
        """Stop reading. A Generate call's cancel cancels its sequence; a resumed sequence is driven by
        another call (or coordinator), so it is cancelled by a Cancel RPC as well."""
        if self._done:
            return
        self._cancelled = True
        self.call.cancel()
        if self.resumes or self._generations > 1:
            asyncio.ensure_future(self._cancel_sequence())

    async def _cancel_sequence(self) -> None:
        for stub in self.stubs[self.index:] + self.stubs[:self.index]:
            try:
                await stub.Cancel(cpb.CancelRequest(sequence_id=self.sequence_id), timeout=10, metadata=self.metadata)
                return
            except grpc.aio.AioRpcError as e:
                log.info("cannot cancel %s through a coordinator: %s", self.sequence_id, e.details())

    def cancelled(self) -> bool:
        return self._cancelled


class _after:
    """A server-streaming call opened after `delay_s` (a pause once every coordinator was tried),
    with the stream-call methods `ResumingCall` uses."""

    def __init__(self, delay_s: float, method, request, metadata) -> None:
        self._delay_s, self._method, self._request, self._metadata = delay_s, method, request, metadata
        self._call = None
        self._cancelled = False

    async def read(self):
        if self._call is None:
            if self._delay_s:
                await asyncio.sleep(self._delay_s)
            if self._cancelled:
                return grpc.aio.EOF
            self._call = self._method(self._request, metadata=self._metadata)
        return await self._call.read()

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
