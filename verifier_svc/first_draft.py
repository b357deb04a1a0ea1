"""Round 1's tree drafted inside the Prefill (VerifierPrefillRequest.next_draft).

    first = FirstDrafts()
    features, drafted = await first.take(seq_id, nxt, offset, prompt, result, more, draft)
    first.forget(seq_id)

Without it the prompt's features [L, F] travel verifier -> coordinator -> drafter before round 1's
tree exists, even when the drafter is the verifier's own process (--draft): on the 2-core CPU 40-70
ms a request with the default model; on a GPU an EAGLE-3 head's features of an 8k-token prompt on the
Llama-3.1-8B shape are ~200 MB. With `next_draft` the verifier hands them to the drafter itself: its
own head (a verifier that drafts too) or the sequence's drafter in another process (the drafter's
Prefill stream, verifier_svc/direct_draft.py), and answers with the tree and features [0, F].

A prompt the coordinator sends chunk by chunk carries `next_draft` on every chunk: each chunk's
tokens and features are kept here (by offset: a chunk sent again replaces its own) and answered with
features [0, F]; the last chunk drafts from all of them. A draft that fails (a drafter at capacity or
unreachable) answers the last chunk with every row's features, the earlier chunks' first, so the
coordinator's concatenated chunks hold the whole prompt's rows as without `next_draft`: it then
drafts with its own Prefill to the drafter (whose idempotency answers it if the first one ran).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from services.errors import InvalidRequest
from services.rpc.stubs import drafter as dpb

# (tokens [n] prompt[1:] and the first token, features [n, F]) -> the drafter's answer, or None: it failed
Draft = Callable[[torch.Tensor, torch.Tensor], Awaitable[dpb.DraftResponse | None]]


class FirstDrafts:
    """The chunks of prompts whose first tree is drafted here, kept until their last chunk, and each
    last chunk's answer (for that chunk sent again) until the sequence's first round or release."""

    def __init__(self) -> None:
        # sequence id -> offset -> (tokens [c], features [c, F]) of each chunk done so far
        self._rows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        # sequence id -> (its last chunk's offset, the features it answered with, the tree or None)
        self._done: dict[str, tuple[int, torch.Tensor, dpb.DraftResponse | None]] = {}

    def check(self, seq_id: str, offset: int) -> None:
        """Before a chunk at `offset` > 0 with next_draft runs: the chunk at offset 0 had it too."""
        done = self._done.get(seq_id)
        if offset and seq_id not in self._rows and (done is None or done[0] != offset):
            raise InvalidRequest(f"sequence {seq_id!r}: next_draft is set on the chunk at offset {offset} but "
                                 "was not on the chunk at offset 0 (set it on every chunk of a prompt or none)")

    async def take(self, seq_id: str, offset: int, prompt: torch.Tensor, first_token: int,
                   features: torch.Tensor, more: bool, draft: Draft
                   ) -> tuple[torch.Tensor, dpb.DraftResponse | None]:
        """A chunk's answer (prompt [c] at `offset`, its features [c, F]) -> (the features it carries,
        round 1's tree or None). `more`: chunks follow (kept; [0, F]). The last chunk drafts; sent
        again, it gets the same answer."""
        done = self._done.get(seq_id)
        if done is not None and done[0] == offset and not more and seq_id not in self._rows:
            return done[1], done[2]
        rows = self._rows.setdefault(seq_id, {})
        if offset == 0:
            rows.clear()  # (a prompt prefilled again from row 0: after a fail-over, or the first chunk sent again)
            self._done.pop(seq_id, None)
        rows[offset] = (prompt, features)
        if more:
            return features[:0], None
        self._rows.pop(seq_id, None)  # (a release on the model thread may have dropped it)
        parts = [rows[o] for o in sorted(rows)]
        tokens = torch.cat([t for t, _ in parts] + [torch.tensor([first_token], dtype=torch.long)])[1:]
        every = torch.cat([f for _, f in parts]) if len(parts) > 1 else features
        assert every.shape[0] == tokens.shape[0] == offset + prompt.shape[0], (every.shape, tokens.shape, offset)
        drafted = await draft(tokens, every)
        # a draft that failed: the coordinator drafts, and gets every row (the earlier chunks' came empty)
        answer = (every, None) if drafted is None else (features[:0], drafted)
        self._done[seq_id] = (offset, *answer)
        return answer

    def settled(self, seq_id: str) -> None:
        """The sequence's first round reached the verifier: its last chunk will not be sent again (a
        failed draft's answer holds every row's features: not kept for the sequence's life)."""
        self._done.pop(seq_id, None)

    def forget(self, seq_id: str) -> None:
        self._rows.pop(seq_id, None)
        self._done.pop(seq_id, None)
