"""Direct drafts: the verifier sends the Draft of a verdict straight to the sequence's drafter.

    drafts = DirectDrafts(config.service)
    drafted = await drafts.draft(seq_id, NextDraftTo(index, params, "10.0.0.7:50052"), response, 5.0)
    await drafts.close()

A split pipeline's EAGLE round is four hops (coordinator -> drafter -> coordinator -> verifier ->
coordinator). With `NextDraft.drafter` (coordinator --direct-drafts) the coordinator sends one Verify;
once its forward has answered, the verifier sends the Draft the coordinator would have sent after the
verdict (the accepted tokens and the bonus, the features of the root and the accepted nodes, the same
idempotency index) to that drafter and answers with the tree (`VerifyResponse.next_tree`): the
features never travel back to the coordinator, and in a VerifyRun the coordinator is out of the loop
(two hops a round: verifier -> drafter -> verifier).

The Draft runs on the event loop (grpc.aio), never on the model thread: the verifier's forward for
other sequences goes on while a drafter drafts. A drafter that fails, is too slow for the Verify's
deadline or cannot be reached leaves the answer as a plain Verify's (no next_tree, the features
kept): the coordinator then drafts with a Draft call at the same index (the drafter's idempotency
answers it if the first one ran) and fails over as usual. Calls carry this process's bearer token and
present its certificate (services/rpc/security.py). With tracing on, each Draft runs under a
`next_draft` CLIENT span (specdec.round_index: the round the tree is for; aerie.drafter: the address)
below the Verify's (or VerifyRun's) server span, and carries its `traceparent`: the drafter's Draft
server span joins the request's trace, after the verify on the timeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from services import telemetry
from services.errors import InvalidRequest
from services.rpc import codec
from services.rpc.channel import call_metadata, open_aio_channel
from services.rpc.config import ServiceConfig
from services.rpc.security import Security
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import drafter_grpc
from services.rpc.stubs import verifier as vpb
from services.spec.tree import TreeParams

log = logging.getLogger("aerie.verifier")

MAX_ADDRESS = 256  # NextDraft.drafter: host:port, at most this many characters
MAX_CHANNELS = 64  # drafters this verifier keeps a channel open to (the least recently used is closed)


@dataclass(frozen=True, slots=True)
class NextDraftTo:
    """A Verify's next draft at a drafter in another process (NextDraft with `drafter`)."""
    index: int  # the Draft call's idempotency index
    params: TreeParams | None  # the tree's shape (None: the drafter's largest)
    drafter: str  # host:port


def check_address(address: str) -> str:
    """NextDraft.drafter: a host:port (InvalidRequest names a bad one)."""
    host, _, port = address.rpartition(":")
    if len(address) > MAX_ADDRESS or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(
            c.isspace() for c in address):
        raise InvalidRequest(f"next_draft.drafter must be host:port (at most {MAX_ADDRESS} characters); "
                             f"got {address[:MAX_ADDRESS]!r}")
    return address


class DirectDrafts:
    """Channels to drafters (opened on first use, on the event loop) and the Draft of a verdict."""

    def __init__(self, service: ServiceConfig, security: Security | None = None) -> None:
        self.max_message_bytes = service.max_message_bytes
        self.chunk_bytes = service.chunk_bytes  # a Prefill stream's tensor bytes per message
        self.security = security if security is not None else Security.load(service)
        self.metadata = call_metadata(self.security)
        self._stubs: dict[str, tuple[grpc.aio.Channel, drafter_grpc.DrafterStub]] = {}

    def _stub(self, address: str) -> drafter_grpc.DrafterStub:
        entry = self._stubs.pop(address, None)
        if entry is None:
            if len(self._stubs) >= MAX_CHANNELS:  # the least recently used (first in insertion order)
                old = next(iter(self._stubs))
                channel, _ = self._stubs.pop(old)
                asyncio.ensure_future(channel.close())  # in the background
            channel = open_aio_channel(address, self.max_message_bytes, self.security)
            entry = (channel, drafter_grpc.DrafterStub(channel))
        self._stubs[address] = entry  # most recent last
        return entry[1]

    async def draft(self, seq_id: str, nxt: NextDraftTo, response: vpb.VerifyResponse, timeout_s: float) -> bool:
        """Draft the next tree from `response`'s verdict at `nxt.drafter` and add it to `response`
        (next_tree, next_draft_seconds, drafter_busy; its features then [0, F]: the drafter took
        them). False, `response` unchanged, when the verdict carries rows Decode calls kept (they are
        the coordinator's to send) or the drafter did not answer with a tree."""
        tokens = [*response.tokens[1:], response.bonus]  # [m + 1] the accepted tokens and the bonus
        if not response.features.shape or response.features.shape[0] != len(tokens):
            return False
        request = dpb.DraftRequest(sequence_id=seq_id, round_index=nxt.index, tokens=tokens,
                                   features=response.features)
        if nxt.params is not None:
            request.tree.CopyFrom(codec.encode_tree_params(nxt.params))
        t0 = time.perf_counter()
        drafted = await self.call(seq_id, nxt.drafter, "Draft", request, timeout_s)
        if drafted is None:
            return False
        take_tree(response, drafted, time.perf_counter() - t0)
        return True

    async def prefill(self, seq_id: str, nxt: NextDraftTo, tokens: torch.Tensor, features: torch.Tensor,
                      max_rows: int, sampling: bool, timeout_s: float) -> dpb.DraftResponse | None:
        """Round 1's tree from a prompt prefilled here (verifier_svc/first_draft.py): the drafter's
        Prefill stream (tokens [L] prompt[1:] and the first token, features [L, F], a draft KV of
        `max_rows` rows) at `nxt.drafter`, at index `nxt.index`; None when it fails."""
        messages = codec.drafter_prefill(seq_id, max_rows, sampling, tokens, features, nxt.params, nxt.index,
                                         self.chunk_bytes)
        return await self.call(seq_id, nxt.drafter, "Prefill", messages, timeout_s, round_index=nxt.index)

    async def call(self, seq_id: str, drafter: str, method: str, request, timeout_s: float,
                   round_index: int | None = None) -> dpb.DraftResponse | None:
        """One Draft, DraftAhead or Prefill call (`method`; a Prefill's `request` is its message
        iterator, `round_index` its index) at `drafter`, with this process's credentials and, with
        tracing on, under a CLIENT span (next_draft / draft_ahead) whose traceparent it carries; None
        when it fails (logged: the coordinator drafts)."""
        index = request.round_index if round_index is None else round_index
        attributes = {telemetry.SEQ_ID: seq_id, telemetry.ROUND_INDEX: index, telemetry.DRAFTER: drafter}
        name = "draft_ahead" if method == "DraftAhead" else "next_draft"
        with telemetry.start_span(name, kind="client", attributes=attributes) as span:
            metadata = list(self.metadata)
            telemetry.inject(metadata)  # (the span's context; nothing when tracing is off)
            try:
                return await getattr(self._stub(drafter), method)(request, timeout=max(timeout_s, 0.001),
                                                                  metadata=metadata)
            except grpc.aio.AioRpcError as e:
                telemetry.record_error(span, e)
                log.info("sequence %s: the %s at drafter %s failed (%s: %s); its coordinator drafts with a "
                         "Draft call", seq_id, method, drafter, e.code().name, e.details())
                return None

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


def take_tree(response: vpb.VerifyResponse, drafted: dpb.DraftResponse, seconds: float) -> None:
    """The drafter's next tree into a Verify's answer; the drafter took the verdict's rows (features [0, F])."""
    response.next_tree.CopyFrom(drafted.tree)
    response.next_draft_seconds = seconds
    response.drafter_busy = drafted.busy
    dtype, width = response.features.dtype, response.features.shape[1] if len(response.features.shape) > 1 else 0
    response.features.Clear()  # [0, F] of the same dtype
    response.features.dtype = dtype
    response.features.shape.extend([0, width])
