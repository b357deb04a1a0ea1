"""The two seams of the round loop: what `Engine` needs from a drafter and from a verifier.

Each role has two implementations: in process (`services.engine.drafter.Drafter`,
`services.engine.verifier.Verifier`) and over gRPC (`services.rpc.clients.RemoteDrafter`,
`RemoteVerifier`; the coordinator wraps them with fail-over in `coordinator.sequence_placement`),
so the round semantics live in one place, `Engine`. `Engine` is typed against these protocols.

Drafting ahead (Engine's `ahead`) needs one more drafter method, `draft_ahead(seq_id, tokens,
features, guess, params, round_index, branches, exclude) -> DraftTree | None`
(services/engine/drafter.py documents it; over gRPC the DraftAhead call, `RemoteDrafter.draft_ahead`,
and the coordinator's placement wraps it with fail-over); the engine checks for it when built with
`ahead`, so a drafter without it still serves every other use. It is called from the engine's
drafter thread while `verify` runs. An optional `busy` attribute (0..1, the drafter's load as the
sequence sees it; a remote drafter reports it with each answer) feeds the overlap policy.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from services.engine.verifier import PrefillResult, VerifyResult
from services.spec.logprobs import TokenLogprobs
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams

# The target features a sequence's results carry: the post-norm last hidden state (EAGLE-1/2), the
# three layer taps (EAGLE-3), or none (plain decoding, retrieval only).
FeatureKind = Literal["hidden", "taps", "none"]


class DrafterRole(Protocol):
    @property
    def tree(self) -> TreeParams:
        """The largest shape it grows (its draft KV is sized for it; the engine's budget stays within)."""

    @property
    def feature_kind(self) -> FeatureKind:
        """'hidden' (EAGLE-1/2) or 'taps' (EAGLE-3): the target features the head consumes."""

    def start(self, seq_id: str, max_rows: int, sampling: bool) -> None:
        """Reserve a draft KV for `max_rows` committed rows plus one tree expansion; `sampling` sorts
        paths for rejection sampling. Raises InvalidRequest (duplicate id) or CapacityExceeded."""

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None) -> DraftTree:
        """tokens [n] committed tokens the draft KV has not seen, shifted by one (last = the new root),
        features [n, F] their target features -> the next tree, of shape `params` (None: `tree`).
        Raises SequenceNotFound, InvalidRequest."""

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
