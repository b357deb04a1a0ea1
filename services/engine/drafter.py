"""Drafter: holds an EAGLE head and a draft KV per sequence, and grows the EAGLE-2 tree.

`draft` grows one sequence's tree; `draft_many` grows many sequences' trees with one head step per
level for all of them (the drafter service gathers concurrent calls into it).

The in-process implementation of the drafter role; the drafter service wraps this class unchanged.
It does not know the target model, sampling or stop rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.errors import AerieError, CapacityExceeded, InvalidRequest, SequenceNotFound
from services.model.eagle_head import DraftHead
from services.model.kv_cache import KVCache
from services.spec.tree import DraftTree, TreeParams, grow_trees


@dataclass(frozen=True, slots=True)
class DraftCall:
    seq_id: str
    tokens: torch.Tensor  # [n] newly committed tokens shifted by one (last = the root)
    features: torch.Tensor  # [n, F] target features of the rows before them
    params: TreeParams | None = None  # this round's shape (None = the drafter's largest)


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
                f"tree shape top_k={params.top_k}, depth={params.depth}, tokens={params.size} exceeds "
                f"this drafter's largest shape top_k={self.tree.top_k}, depth={self.tree.depth}, "
                f"tokens={self.tree.size} (its draft KV is sized for that)")
        if params.top_k > self.head.config.draft_vocab:
            raise InvalidRequest(
                f"tree_top_k={params.top_k} exceeds the draft vocabulary ({self.head.config.draft_vocab})")

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None) -> DraftTree:
        """tokens [n] newly committed tokens shifted by one (last = root); features [n, F];
        `params` this round's shape (None = the largest)."""
        out = self.draft_many([DraftCall(seq_id, tokens, features, params)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def draft_many(self, calls: list["DraftCall"]) -> list[DraftTree | AerieError]:
        """Grow the trees of many sequences with one head step per level (tree.grow_trees), in
        order; an invalid call's error takes its place and the others draft without it."""
        results: list[DraftTree | AerieError | None] = [None] * len(calls)
        valid: list[int] = []
        shapes: list[TreeParams] = []
        seen: set[str] = set()
        for i, call in enumerate(calls):
            try:
                if call.seq_id in seen:
                    raise InvalidRequest(f"sequence {call.seq_id!r} has two draft calls in one batch")
                self._cache(call.seq_id)
                params = self.tree if call.params is None else call.params
                if call.params is not None:
                    self.check_params(params)
                f = self.head.config.feature_size
                n = call.tokens.shape[0] if call.tokens.ndim == 1 else -1
                if n < 1 or call.features.ndim != 2 or call.features.shape != (n, f):
                    raise InvalidRequest(
                        f"features must have shape [{n}, {f}]; got {list(call.features.shape)}")
                cache = self._caches[call.seq_id]
                if cache.length + n + params.draft_rows > cache.capacity:  # checked here: fails alone
                    raise CapacityExceeded(
                        f"draft KV of sequence {call.seq_id!r} holds {cache.capacity} rows; {cache.length} used, "
                        f"{n} committed rows and {params.draft_rows} tree rows requested")
            except AerieError as e:
                results[i] = e
                continue
            seen.add(call.seq_id)
            valid.append(i)
            shapes.append(params)
        if valid:
            dev = self.head.device
            trees = grow_trees(self.head, [self._caches[calls[i].seq_id] for i in valid],
                               [calls[i].features.to(dev) for i in valid], [calls[i].tokens.to(dev) for i in valid],
                               shapes, [self._sort_paths[calls[i].seq_id] for i in valid])
            for i, tree in zip(valid, trees):
                results[i] = tree
        return results  # type: ignore[return-value]

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
