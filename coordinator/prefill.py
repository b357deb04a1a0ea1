"""One prefill (or fail-over rebuild) sent to a verifier chunk by chunk, each chunk its own call and
deadline.

    prefill = ChunkedPrefill(seq_id, rows, sampling, capacity, rebuild, tries=3, stop=run_stopped)
    result = prefill.run(rv)      # from the chunks already done on this verifier
    prefill.restart()             # another verifier (or one that lost the sequence): from row 0 again

Why chunks: a deadline over a whole long prompt (8,000 tokens on a CPU take minutes) expires however
healthy the verifier is, and a retry from row 0 expires again. Here each chunk (the verifier's
AERIE_PREFILL_CHUNK rows, from its GetInfo; a verifier that reports 0 gets the whole prompt in one
call) has the coordinator's AERIE_RPC_TIMEOUT_S, and the rows done stay done:

    chunk k misses its deadline -> sent again to the same verifier (slow is not dead), which runs it,
                                   or answers from its stored answer when it ran meanwhile
    `tries` deadlines in a row   -> PrefillTimedOut: DEADLINE_EXCEEDED naming the chunk, the rows done
                                   and the knobs; the sequence fails (never a fail-over: a replica
                                   that answers slowly is not moved away from and back to)
    any other failure            -> raised as it is (sequence_placement.py decides: fail-over or not)
    stop() before every chunk    -> PrefillStopped: Cancel, a client gone or a hand-over ends the
                                   prefill within one chunk

It does not pick, mark or release replicas (sequence_placement.py does) and never talks to Redis
(the `stop` callable may).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import torch

from services import metrics
from services.engine.verifier import PrefillResult, merge_prefill
from services.rpc.clients import NextDraft, RemoteVerifier
from services.rpc.errors import DownstreamError
from services.spec.sampling import SamplingParams

log = logging.getLogger("aerie.coordinator")


class PrefillTimedOut(DownstreamError):
    """A prefill chunk missed its deadline `tries` times in a row on one verifier (DEADLINE_EXCEEDED;
    not a fail-over)."""


class PrefillStopped(Exception):
    """The prefill was stopped between two chunks (`reason`: "cancel" or "hand-over")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ChunkedPrefill:
    def __init__(self, seq_id: str, rows: list[int], sampling: SamplingParams, capacity: int, rebuild: bool,
                 tries: int, stop: Callable[[], None] = lambda: None,
                 next_draft: Callable[[RemoteVerifier], NextDraft | None] | None = None) -> None:
        """rows [L]: the prompt (or, `rebuild`, prompt + committed tokens but the last); `tries` >= 1:
        calls per chunk before PrefillTimedOut; `stop()` raises PrefillStopped to end the prefill.
        `next_draft(rv)`: round 1's tree drafted in the prefill on `rv` (VerifierPrefillRequest.next_draft,
        on every chunk), or None; asked when a verifier starts the prompt from row 0."""
        assert rows and tries >= 1, (len(rows), tries)
        self.seq_id = seq_id
        self.rows = rows
        self.sampling = sampling
        self.capacity = capacity
        self.rebuild = rebuild
        self.tries = tries
        self.stop = stop
        self.done = 0  # rows the current verifier holds
        self.parts: list[PrefillResult] = []  # per chunk done: its features [c, F] (and prompt logprobs)
        self.calls = 0  # chunk calls sent (tries included), for logs and tests
        self.next_draft = next_draft
        self._next: NextDraft | None = None  # what the chunks on the current verifier carry

    def restart(self) -> None:
        """The next run() goes to a verifier that holds none of the rows: start from row 0."""
        self.done, self.parts = 0, []

    def run(self, rv: RemoteVerifier) -> PrefillResult:
        """Prefill the rows not done yet on `rv` -> (first token, features [L, F] of every row, the
        prompt log-probabilities of rows 1..L-1 when sampling.prompt_logprobs asks)."""
        size = rv.prefill_chunk or len(self.rows)
        total = len(self.rows)
        if self.done == 0:
            self._next = self.next_draft(rv) if self.next_draft is not None else None
        while self.done < total:
            self.stop()
            start, end = self.done, min(self.done + size, total)
            part = torch.tensor(self.rows[start:end], dtype=torch.long)
            for attempt in range(1, self.tries + 1):
                self.calls += 1
                try:
                    pre = rv.prefill(self.seq_id, part, self.sampling, self.capacity, rebuild=self.rebuild,
                                     offset=start, prompt_tokens=total, next_draft=self._next)
                    break
                except DownstreamError as e:
                    if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    chunk = f"chunk {start // size + 1} of {-(-total // size)} (rows {start}..{end - 1})"
                    metrics.PREFILL_CHUNK_TIMEOUTS.labels("coordinator").inc()
                    if attempt == self.tries:
                        raise PrefillTimedOut(grpc.StatusCode.DEADLINE_EXCEEDED, (
                            f"sequence {self.seq_id!r}: prefill {chunk} on verifier {rv.client.address} missed its "
                            f"{rv.client.timeout_s:g} s deadline {self.tries} times (AERIE_RPC_TIMEOUT_S, "
                            f"AERIE_PREFILL_TRIES); {start} of {total} rows were prefilled")) from None
                    log.warning("sequence %s: prefill %s on %s missed its %g s deadline (try %d of %d); "
                                "sending it again", self.seq_id, chunk, rv.client.address, rv.client.timeout_s,
                                attempt, self.tries)
                    self.stop()
            self.parts.append(pre)
            self.done = end
        return merge_prefill(self.parts)
