"""Verifier: holds the target model and a KV per sequence; prefill, tree verification, plain decode.

The in-process implementation of the verifier role; the verifier service wraps this class unchanged.
Acceptance itself is `services.spec.verify`; this class runs the target forward around it, compacts
the KV to the accepted path and returns the accepted nodes' features for the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.errors import CapacityExceeded, InvalidRequest, SequenceNotFound
from services.model.kv_cache import KVCache
from services.model.target import TargetModel
from services.spec.sampling import SamplingParams, next_token, round_generator
from services.spec.tree import DraftTree
from services.spec.verify import Acceptance, accept


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first_token: int  # sampled from the last prompt row with the round-0 generator
    features: torch.Tensor  # [L, F] target features of the prompt rows


@dataclass(frozen=True, slots=True)
class VerifyResult:
    acceptance: Acceptance
    features: torch.Tensor  # [m + 1, F] target features of the root and the accepted nodes ([0, H]
    #                         for a sequence prefilled with feature kind "none": no head consumes them)


@dataclass
class _Sequence:
    cache: KVCache
    sampling: SamplingParams


class Verifier:
    def __init__(self, target: TargetModel, feature_kind: str = "hidden", max_sequences: int = 64) -> None:
        assert feature_kind in ("hidden", "taps", "none"), feature_kind
        self.target = target
        self.feature_kind = feature_kind
        self.max_sequences = max_sequences
        self._seqs: dict[str, _Sequence] = {}

    def prefill(self, seq_id: str, prompt: torch.Tensor, sampling: SamplingParams, capacity: int
                ) -> PrefillResult:
        """prompt [L]; `capacity` KV rows (prompt + generated tokens + one tree)."""
        if seq_id in self._seqs:
            raise InvalidRequest(f"sequence {seq_id!r} already exists on this verifier")
        if len(self._seqs) >= self.max_sequences:
            raise CapacityExceeded(f"verifier holds its maximum of {self.max_sequences} sequences")
        seq = _Sequence(self.target.new_cache(capacity), sampling)
        out = self.target(prompt.to(self.target.device), seq.cache, logits_for="last",
                          want_taps=self.feature_kind == "taps")
        self._seqs[seq_id] = seq
        gen = None if sampling.greedy else round_generator(sampling.seed, 0, out.logits.device)
        return PrefillResult(next_token(out.logits[-1], sampling, gen), self._features(out))

    def verify(self, seq_id: str, tree: DraftTree, round_index: int) -> VerifyResult:
        """Run the tree in one forward, accept, keep the accepted path's KV."""
        seq = self._get(seq_id)
        prefix = seq.cache.length
        tree = tree.to(self.target.device)  # tokens, depths, mask and paths live with the model
        out = self.target(tree.tokens, seq.cache, positions=prefix + tree.depths, tree_mask=tree.mask,
                          want_taps=self.feature_kind == "taps")
        gen = None if seq.sampling.greedy else round_generator(seq.sampling.seed, round_index, out.logits.device)
        acc = accept(tree, out.logits, seq.sampling, gen)  # the round's one host copy: the accepted path
        nodes = acc.nodes.to(self.target.device)
        seq.cache.keep(prefix, prefix + nodes)
        features = self._features(out)
        return VerifyResult(acc, features[nodes] if features.shape[0] else features)

    def decode(self, seq_id: str, token: int, round_index: int) -> int:
        """Plain autoregressive step (the no-draft baseline): commit `token`, return the next one."""
        seq = self._get(seq_id)
        out = self.target(torch.tensor([token], device=self.target.device), seq.cache, logits_for="last")
        gen = None if seq.sampling.greedy else round_generator(seq.sampling.seed, round_index, out.logits.device)
        return next_token(out.logits[-1], seq.sampling, gen)

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def _get(self, seq_id: str) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise SequenceNotFound(f"unknown sequence {seq_id!r} on this verifier") from None

    def _features(self, out) -> torch.Tensor:
        if self.feature_kind == "taps":
            return out.taps
        if self.feature_kind == "hidden":
            return out.hidden
        return out.hidden[:0]
