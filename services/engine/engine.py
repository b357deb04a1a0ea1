"""The round loop: prefill, then draft -> verify -> commit until a stop condition.

    prefill  the verifier runs the prompt and samples the first token (the first root)
    draft    the drafter extends its KV with the newly committed rows and grows a tree
    verify   the verifier checks the tree in one forward, accepts a path, draws the bonus
    commit   the accepted tokens and the bonus are emitted; stop rules truncate

`Engine` talks to a `Drafter` and a `Verifier` through their methods only, so the coordinator can
drive gRPC clients with the same loop. With no drafter it runs plain autoregressive decoding through
the same target code: the baseline. It does not tokenize or format prompts.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from services.engine.drafter import Drafter
from services.engine.verifier import Verifier
from services.errors import InvalidRequest
from services.spec.sampling import SamplingParams

_seq_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class RoundStats:
    index: int  # 0 = prefill
    accept_length: int  # tokens this target forward produced (accepted drafts + bonus); 1 for prefill
    tree_size: int  # nodes verified, root included (0 for prefill / plain decode)
    tree_depth: int  # deepest node verified
    draft_s: float  # time growing the tree that this round verified
    verify_s: float  # time in the verifier (target forward + acceptance + KV compaction)


@dataclass(frozen=True, slots=True)
class StepOutput:
    tokens: list[int]  # newly committed tokens, stop-truncated
    stats: RoundStats
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished


def check_stop(new: list[int], produced: int, max_new_tokens: int, stop_ids: frozenset[int]
               ) -> tuple[list[int], str | None]:
    """Truncate `new` at the first stop token (kept) or at the token budget; tokens after a stop are
    dropped. Example: new [5, 9, 2, 7], stop {2}, produced 10, max 100 -> ([5, 9, 2], "stop")."""
    for i, tok in enumerate(new):
        if produced + i + 1 > max_new_tokens:
            return new[:i], "length"
        if tok in stop_ids:
            return new[: i + 1], "stop"
    if produced + len(new) >= max_new_tokens:
        return new, "length"
    return new, None


class Engine:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, max_context: int,
                 vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def validate(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise InvalidRequest("prompt is empty: give at least one token")
        for i, tok in enumerate(req.prompt_ids):
            if not 0 <= tok < self.vocab_size:
                raise InvalidRequest(
                    f"prompt token id {tok} at position {i} is outside the vocabulary [0, {self.vocab_size})")
        for tok in req.stop_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise InvalidRequest(f"stop token id {tok} is outside the vocabulary [0, {self.vocab_size})")
        if req.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1; got {req.max_new_tokens}")
        total = len(req.prompt_ids) + req.max_new_tokens
        if total > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"exceeds the model context of {self.max_context} tokens")

    def stop_ids(self, req: GenerationRequest) -> frozenset[int]:
        eos = () if req.ignore_eos else self.eos_token_ids
        return frozenset(req.stop_token_ids) | frozenset(eos)

    def generate(self, req: GenerationRequest, seq_id: str | None = None) -> Iterator[StepOutput]:
        """Yield one StepOutput after prefill and one per round; the last has a finish_reason."""
        self.validate(req)
        seq_id = seq_id or f"local-{next(_seq_counter)}"
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long)
        # KV rows: every committed token plus one tree (or one decode token) in flight
        tree_nodes = self.drafter.tree.total_tokens if self.drafter else 1
        capacity = len(req.prompt_ids) + req.max_new_tokens + tree_nodes
        stop_ids = self.stop_ids(req)
        try:
            yield from self._run(req, seq_id, prompt, capacity, stop_ids)
        finally:
            self.verifier.release(seq_id)
            if self.drafter:
                self.drafter.release(seq_id)

    def _run(self, req, seq_id, prompt, capacity, stop_ids) -> Iterator[StepOutput]:
        t0 = time.perf_counter()
        pre = self.verifier.prefill(seq_id, prompt, req.sampling, capacity)
        verify_s = time.perf_counter() - t0
        draft_s = 0.0
        tree = None
        produced = 0
        new, reason = check_stop([pre.first_token], produced, req.max_new_tokens, stop_ids)
        if reason is None and self.drafter:
            t1 = time.perf_counter()
            self.drafter.start(seq_id, capacity, sampling=not req.sampling.greedy)
            shifted = torch.cat([prompt[1:], torch.tensor([pre.first_token])])
            tree = self.drafter.draft(seq_id, shifted, pre.features)
            draft_s = time.perf_counter() - t1
        produced += len(new)
        yield StepOutput(new, RoundStats(0, 1, 0, 0, 0.0, verify_s), reason)
        last = pre.first_token
        for index in itertools.count(1):
            if reason is not None:
                return
            t1 = time.perf_counter()
            if tree is None:  # plain decoding: one token per target forward
                fresh = [self.verifier.decode(seq_id, last, index)]
                stats = RoundStats(index, 1, 0, 0, 0.0, time.perf_counter() - t1)
            else:
                res = self.verifier.verify(seq_id, tree, index)
                verify_s = time.perf_counter() - t1
                fresh = res.acceptance.new_tokens
                stats = RoundStats(index, len(fresh), tree.size, tree.max_depth, draft_s, verify_s)
            new, reason = check_stop(fresh, produced, req.max_new_tokens, stop_ids)
            produced += len(new)
            last = fresh[-1]
            if reason is None and tree is not None:
                t2 = time.perf_counter()
                tree = self.drafter.draft(seq_id, torch.tensor(fresh), res.features)
                draft_s = time.perf_counter() - t2
            yield StepOutput(new, stats, reason)
