"""Drafter: holds an EAGLE head and a draft KV per sequence, and grows the EAGLE-2 tree.

The in-process implementation of the drafter role; the drafter service wraps this class unchanged.
It does not know the target model, sampling or stop rules.
"""

from __future__ import annotations

import torch

from services.errors import CapacityExceeded, InvalidRequest, SequenceNotFound
from services.model.eagle_head import DraftHead
from services.model.kv_cache import KVCache
from services.spec.tree import DraftTree, TreeParams, grow_tree


class Drafter:
    """`tree` is the largest shape a call may ask for (it sizes the draft KV); `draft(..., params)`
    grows any shape it covers (the budget picks one per round), `params=None` grows `tree` itself."""

    def __init__(self, head: DraftHead, tree: TreeParams, max_sequences: int = 64) -> None:
        if tree.top_k > head.draft_vocab_size:
            raise InvalidRequest(
                f"tree_top_k={tree.top_k} exceeds the draft vocabulary ({head.draft_vocab_size})")
        self.head = head
        self.tree = tree
        self.max_sequences = max_sequences
        self._caches: dict[str, KVCache] = {}
        self._sort_paths: dict[str, bool] = {}

    @property
    def feature_kind(self) -> str:
        return self.head.feature_kind

    def start(self, seq_id: str, max_rows: int, sampling: bool) -> None:
        """Reserve a draft KV for up to `max_rows` committed rows plus one tree expansion."""
        if seq_id in self._caches:
            raise InvalidRequest(f"sequence {seq_id!r} already exists on this drafter")
        if len(self._caches) >= self.max_sequences:
            raise CapacityExceeded(f"drafter holds its maximum of {self.max_sequences} sequences")
        self._caches[seq_id] = self.head.new_cache(max_rows + self.tree.draft_rows)
        self._sort_paths[seq_id] = sampling

    def check_params(self, params: TreeParams) -> None:
        if not self.tree.covers(params):
            raise InvalidRequest(
                f"tree shape top_k={params.top_k}, depth={params.depth}, tokens={params.total_tokens} exceeds "
                f"this drafter's largest shape top_k={self.tree.top_k}, depth={self.tree.depth}, "
                f"tokens={self.tree.total_tokens} (its draft KV is sized for that)")
        if params.top_k > self.head.config.draft_vocab:
            raise InvalidRequest(
                f"tree_top_k={params.top_k} exceeds the draft vocabulary ({self.head.config.draft_vocab})")

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None) -> DraftTree:
        """tokens [n] newly committed tokens shifted by one (last = root); features [n, F];
        `params` this round's shape (None = the largest)."""
        cache = self._cache(seq_id)
        if params is None:
            params = self.tree
        else:
            self.check_params(params)
        f = self.head.config.feature_size
        if features.ndim != 2 or features.shape != (tokens.shape[0], f):
            raise InvalidRequest(
                f"features must have shape [{tokens.shape[0]}, {f}]; got {list(features.shape)}")
        committed = cache.capacity - self.tree.draft_rows  # the rest is room for one tree expansion
        if cache.length + tokens.shape[0] > committed:  # checked before the KV is touched
            raise CapacityExceeded(f"sequence {seq_id!r} holds {committed} draft KV rows; {cache.length} used, "
                                   f"{tokens.shape[0]} more requested")
        return grow_tree(self.head, cache, features.to(self.head.device), tokens.to(self.head.device),
                         params, self._sort_paths[seq_id])

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)
        self._sort_paths.pop(seq_id, None)

    def _cache(self, seq_id: str) -> KVCache:
        try:
            return self._caches[seq_id]
        except KeyError:
            raise SequenceNotFound(f"unknown sequence {seq_id!r} on this drafter") from None

    @property
    def num_sequences(self) -> int:
        return len(self._caches)
