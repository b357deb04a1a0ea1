"""Drafting ahead inside a run of tree rounds (VerifyRun with `ahead`, the drafter in another process).

    run = AheadRun(drafts, seq_id, "10.0.0.7:50052", RunAhead(1, 5), params, index=7, vocab_size=V)
    launched = run.launch(tree, 5.0)          # DraftAhead for the round now verified (or None)
    await run.settle(response, launched, 5.0)  # the next tree: the ahead one on a hit, else a Draft

With direct drafts a run's round is verify -> Draft -> verify: the drafter idles while the verifier
verifies and the other way round. With `ahead` the verifier sends the drafter a DraftAhead as soon
as it queues a round's verify (the guess: the tree's top path's first `depth` tokens, cut at
`max_guess`; the chain past it and the exclusions as the coordinator's engine sends them,
services/spec/ahead.py chain_past), so the drafter drafts the next tree while the target verifies.
At the verdict: a hit (services/spec/ahead.py use_ahead) makes the next tree that ahead tree rerooted
at the bonus and cut to the run's shape (trim), with no draft waited for; a miss sends the Draft as
without drafting ahead. The coordinator's policy chose `depth` (or no drafting ahead) when it asked
for the run; the verifier drafts ahead in every round of it.

Rows: a DraftAhead carries the rows the drafter's KV has not taken yet (a hit's verdict rows: the
ahead tree was drafted before them), a miss's Draft its verdict's rows; `pending` holds them in
between. Every answer of such a run says exactly which rows the KV has not taken (`features`, with
`pending_rows`: the coordinator replaces what it holds by them) and the Drafter index of the
latest call the drafter answered (`draft_index`); the coordinator continues from there when the run
ends. Calls go one at a time per sequence from this coroutine, so the drafter always takes them in
index order. A Draft that fails leaves its rows in `features` (the coordinator's Draft at the same
index is answered by the drafter's replay if it ran); a DraftAhead that fails sets `ahead_failed`
and leaves the rows it carried in `features` too (they may or may not be in the KV: the coordinator's
Draft, numbered past the failed call, says where its rows go, `first_row`). Either ends the run (no
next tree).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from services.errors import InvalidRequest
from services.rpc import codec
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.spec.ahead import chain_past, top_guess, trim, use_ahead
from services.spec.overlap import RunAhead
from services.spec.tree import DraftTree, TreeParams
from verifier_svc.direct_draft import DirectDrafts, take_tree

MAX_BRANCHES = 8  # DraftAheadRequest.branches (the drafter caps it at its own --ahead-branches)
MAX_GUESS = 66  # RunAhead.max_guess (a drafter's tree depth + 2) at most: a bound on the request, far above any tree


def decode_run_ahead(msg: vpb.RunAhead) -> RunAhead:
    """VerifyRunRequest.ahead, checked (InvalidRequest names the value)."""
    if not 1 <= msg.max_guess <= MAX_GUESS:
        raise InvalidRequest(f"ahead.max_guess must be in [1, {MAX_GUESS}]; got {msg.max_guess}")
    if not 1 <= msg.depth <= msg.max_guess:
        raise InvalidRequest(f"ahead.depth must be in [1, ahead.max_guess = {msg.max_guess}]; got {msg.depth}")
    if not 0 <= msg.branches <= MAX_BRANCHES:
        raise InvalidRequest(f"ahead.branches must be in [0, {MAX_BRANCHES}]; got {msg.branches}")
    return RunAhead(msg.depth, msg.max_guess, msg.branches, msg.sort_paths)


@dataclass(slots=True)
class _Launched:
    """A DraftAhead in flight: what it bet on, and the call."""
    guess: list[int]
    task: asyncio.Future  # -> (DraftResponse | None, seconds)
    rows: list[int]  # the pending rows it carried
    features: torch.Tensor | None  # [len(rows), F] their features (None: no rows)


class AheadRun:
    """One run's drafting ahead at `drafter`: the rows its KV has not taken and the next Drafter index."""

    def __init__(self, drafts: DirectDrafts, seq_id: str, drafter: str, spec: RunAhead,
                 params: TreeParams | None, index: int, vocab_size: int) -> None:
        self.drafts, self.seq_id, self.drafter, self.spec = drafts, seq_id, drafter, spec
        self.params = params  # the run's shape (None: the drafter's largest)
        self.index = index  # the next call's Drafter index
        self.vocab_size = vocab_size
        self.pending_tokens: list[int] = []  # rows the drafter's KV has not taken
        self.pending_features: torch.Tensor | None = None  # [len(pending_tokens), F] (None: none yet)
        self.answered = index - 1  # the index of the latest call the drafter answered

    def launch(self, tree: DraftTree, timeout_s: float) -> _Launched | None:
        """The DraftAhead for the round that verifies `tree` (it runs while the verify does), carrying
        the pending rows; None when the tree has no path to guess on."""
        path = top_guess(tree, min(tree.max_depth, self.spec.max_guess))
        guess = path[: self.spec.depth]
        if not guess:
            return None
        chain, exclude = chain_past(tree, guess, path)
        request = dpb.DraftAheadRequest(sequence_id=self.seq_id, round_index=self.index,
                                        tokens=self.pending_tokens, guess=guess, chain=list(chain),
                                        exclude=[t for e in exclude for t in e],
                                        exclude_sizes=[len(e) for e in exclude], branches=self.spec.branches)
        if self.pending_features is not None and self.pending_tokens:
            request.features.CopyFrom(codec.encode_tensor(self.pending_features))
        if self.params is not None:
            request.tree.CopyFrom(codec.encode_tree_params(self.params))
        self.index += 1
        rows, features = self.pending_tokens, self.pending_features
        self.pending_tokens, self.pending_features = [], None  # (sent: taken, unless the call fails)

        async def call():
            t0 = time.perf_counter()
            answer = await self.drafts.call(self.seq_id, self.drafter, "DraftAhead", request, timeout_s)
            return answer, time.perf_counter() - t0

        return _Launched(guess, asyncio.ensure_future(call()), rows, features if rows else None)

    async def settle(self, response: vpb.VerifyResponse, launched: _Launched | None, timeout_s: float) -> None:
        """Complete `response` (the verdict of the round `launched` was sent beside): its next tree, the
        rows the drafter has not taken (features, pending_rows), draft_index, and the ahead fields."""
        tokens = [*response.tokens[1:], response.bonus]  # [m + 1] the verdict's rows
        features = codec.decode_tensor(response.features, "features", shape=(len(tokens), None))
        response.pending_rows = True
        if launched is not None:
            t0 = time.perf_counter()
            answer, seconds = await launched.task
            response.ahead_seconds = seconds
            response.ahead_wait_seconds = time.perf_counter() - t0
            if answer is None:  # the rows it carried may or may not be in the KV: the coordinator's to send
                response.ahead_failed = True
                if launched.features is not None:
                    response.features.CopyFrom(codec.encode_tensor(torch.cat([launched.features, features])))
                response.draft_index = self.answered
                return
            self.answered = self.index - 1
            response.drafter_busy = answer.busy
            ahead = codec.decode_tree(answer.tree, self.vocab_size) if answer.HasField("tree") else None
            hit = use_ahead(ahead, launched.guess, tokens, self.spec.sort_paths) if ahead is not None else None
            if hit is not None:  # the next tree is ready: the verdict's rows wait for the next call
                if self.params is not None:
                    hit = trim(hit, self.params, self.spec.sort_paths)
                response.next_tree.CopyFrom(codec.encode_tree(hit))
                response.next_tree_ahead = True
                self.pending_tokens, self.pending_features = tokens, features
                response.draft_index = self.answered
                return
        rows = self.pending_tokens + tokens
        rows_features = features if self.pending_features is None else torch.cat([self.pending_features, features])
        request = dpb.DraftRequest(sequence_id=self.seq_id, round_index=self.index, tokens=rows,
                                   features=codec.encode_tensor(rows_features))
        if self.params is not None:
            request.tree.CopyFrom(codec.encode_tree_params(self.params))
        t0 = time.perf_counter()
        drafted = await self.drafts.call(self.seq_id, self.drafter, "Draft", request, timeout_s)
        if drafted is None:  # every row it carried stays the coordinator's to send (the same index)
            response.features.CopyFrom(request.features)
            response.draft_index = self.answered
            return
        self.index += 1
        self.answered = self.index - 1
        self.pending_tokens, self.pending_features = [], None
        take_tree(response, drafted, time.perf_counter() - t0)
        response.draft_index = self.answered
