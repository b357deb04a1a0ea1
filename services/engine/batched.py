"""In-process continuous batching: a Verifier and a Drafter behind batchers, so that many Engine
rounds running in threads share forwards (what the services do for gRPC callers).

    bv = BatchedVerifier(Verifier(target, kind), limits)    # Verifier's methods, thread-safe
    bd = BatchedDrafter(Drafter(head, tree), limits)        # Drafter's methods, thread-safe
    engine = Engine(bv, bd, ...)                            # one Engine; generate() from N threads

Each method call from any thread is queued; calls arriving while a forward runs are gathered into
the next one (services/engine/batcher.py). `aerie generate` keeps batch 1 (plain Verifier/Drafter);
`aerie bench --concurrency N` and the batching tests drive N sequences through these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.engine.batcher import Batcher, BatchLimits
from services.engine.drafter import DraftCall, Drafter
from services.engine.verifier import DecodeCall, PrefillCall, PrefillResult, Verifier, VerifyCall, VerifyResult
from services.spec.sampling import SamplingParams
from services.spec.tree import DraftTree, TreeParams

if TYPE_CHECKING:
    from services.engine.roles import FeatureKind


class BatchedVerifier:
    def __init__(self, verifier: Verifier, limits: BatchLimits = BatchLimits(), on_batch=None) -> None:
        self.inner = verifier
        self.target = verifier.target
        self.feature_kind = verifier.feature_kind
        self.batcher = Batcher("verifier", verifier.run, rows=lambda c: c.rows, key=lambda c: c.seq_id,
                               limits=limits, on_batch=on_batch, expect=lambda: verifier.num_sequences)

    def prefill(self, seq_id: str, prompt: torch.Tensor, sampling: SamplingParams, capacity: int,
                feature_kind: FeatureKind | None = None) -> PrefillResult:
        return self.batcher.call(PrefillCall(seq_id, prompt, sampling, capacity, feature_kind))

    def verify(self, seq_id: str, tree: DraftTree, round_index: int) -> VerifyResult:
        return self.batcher.call(VerifyCall(seq_id, tree, round_index))

    def decode(self, seq_id: str, token: int, round_index: int, keep_features: bool = False) -> int:
        return self.batcher.call(DecodeCall(seq_id, token, round_index, keep_features))

    def take_logprobs(self, seq_id: str):
        """Verifier.take_logprobs (one call of a sequence is in flight at a time)."""
        return self.inner.take_logprobs(seq_id)

    def release(self, seq_id: str) -> None:
        self.batcher.run(self.inner.release, seq_id)

    @property
    def num_sequences(self) -> int:
        return self.inner.num_sequences

    def close(self) -> None:
        self.batcher.close()


class BatchedDrafter:
    def __init__(self, drafter: Drafter, limits: BatchLimits = BatchLimits(), on_batch=None) -> None:
        self.inner = drafter
        self.head = drafter.head
        self.tree = drafter.tree
        self.max_sequences = drafter.max_sequences
        self.batcher = Batcher("drafter", drafter.draft_many, rows=self._rows, key=lambda c: c.seq_id,
                               limits=limits, on_batch=on_batch, expect=lambda: drafter.num_sequences)

    @property
    def feature_kind(self) -> FeatureKind:
        return self.inner.feature_kind

    def _rows(self, call: DraftCall) -> int:
        return int(call.tokens.shape[0]) + (call.params or self.tree).draft_rows

    def start(self, seq_id: str, max_rows: int, sampling: bool) -> None:
        self.batcher.run(self.inner.start, seq_id, max_rows, sampling)

    def check_params(self, params: TreeParams) -> None:
        self.inner.check_params(params)

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None) -> DraftTree:
        return self.batcher.call(DraftCall(seq_id, tokens, features, params))

    def release(self, seq_id: str) -> None:
        self.batcher.run(self.inner.release, seq_id)

    @property
    def num_sequences(self) -> int:
        return self.inner.num_sequences

    def close(self) -> None:
        self.batcher.close()
