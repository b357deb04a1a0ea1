"""The two seams of the round loop: what `Engine` needs from a drafter and from a verifier.

Each role has two implementations: in process (`services.engine.drafter.Drafter`,
`services.engine.verifier.Verifier`) and over gRPC (`services.rpc.clients.RemoteDrafter`,
`RemoteVerifier`), so the round semantics live in one place, `Engine._run`. `Engine` is duck-typed
against these protocols; they exist to document the contract and for type checkers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.engine.verifier import PrefillResult, VerifyResult
from services.spec.logprobs import TokenLogprobs
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams


class DrafterRole(Protocol):
    tree: TreeParams  # the tree shape it grows (the engine sizes KV with total_tokens)

    @property
    def feature_kind(self) -> str:
        """'hidden' (EAGLE-1/2) or 'taps' (EAGLE-3): the target features the head consumes."""

    def start(self, seq_id: str, max_rows: int, sampling: bool) -> None:
        """Reserve a draft KV for `max_rows` committed rows; `sampling` sorts paths for rejection
        sampling. Raises InvalidRequest (duplicate id) or CapacityExceeded."""

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor) -> DraftTree:
        """tokens [n] newly committed tokens shifted by one (last = the new root), features [n, F]
        -> the next tree. Raises SequenceNotFound, InvalidRequest."""

    def release(self, seq_id: str) -> None:
        """Free the sequence's draft KV; unknown ids are ignored. Never raises."""


class VerifierRole(Protocol):
    def prefill(self, seq_id: str, prompt: torch.Tensor, sampling: SamplingParams, capacity: int
                ) -> PrefillResult:
        """prompt [L]: run it into a new KV of `capacity` rows, sample the first token (round 0)."""

    def verify(self, seq_id: str, tree: DraftTree, round_index: int) -> VerifyResult:
        """Tree-attention forward, acceptance with the round's generator, KV compaction."""

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int:
        """Plain decoding: commit `token`, return the next one. `keep_features` (a detached drafter):
        the verifier keeps the row's features and the next `verify` returns them first."""

    def take_logprobs(self, seq_id: str) -> TokenLogprobs | None:
        """The target's log-probabilities of the tokens the latest prefill / verify / decode produced
        (None unless the sequence's SamplingParams.logprobs is set); read once."""

    def release(self, seq_id: str) -> None:
        """Free the sequence's KV; unknown ids are ignored. Never raises."""
