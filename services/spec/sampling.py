"""Sampling parameters, the logits processor, and the per-round random generator.

The processor matches the reference's `prepare_logits_processor` (transformers warpers in the order
temperature -> top-p -> top-k), then min-p (transformers' MinPLogitsWarper; it keeps the tokens whose
probability is at least min_p times the largest, a ratio the earlier filters do not change, so its
place in the order does not matter); the same processed distribution serves acceptance and the bonus
token, which losslessness needs (eagle.md 3.3 (c)). The repetition penalty depends on the context
(services/spec/penalty.py): the verifier applies it to the target's logits of every tree node, each
with its own context, before this processor, so acceptance still compares against the target's
processed distribution. Draws come from a `torch.Generator` seeded by
(sequence seed, round index), so any round can be replayed after a failure. The draft is never
tempered: temperature only shapes the target distribution.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from services.errors import InvalidRequest

GREEDY_TEMPERATURE = 1e-5  # the reference treats temperature <= 1e-5 as greedy
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit for top_logprobs)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or <= 1e-5) = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int = 0
    min_p: float = 0.0  # keep tokens with p >= min_p * max p; 0 = off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the context; 1 = off
    logprobs: int | None = None  # None = off; k >= 0: the chosen token's log-probability and the top k
    prompt_logprobs: int | None = None  # None = off; k >= 0: each prompt token's (but the first) and the top k

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0; got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off); got {self.top_k}")
        if not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2**63); got {self.seed}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1]; got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0 (1 = off); got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]; got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]; got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] fp32 -> processed logits [..., V] (filtered entries are -inf)."""
    x = logits.float()
    if params.temperature != 1.0:
        x = x / params.temperature
    if params.top_p < 1.0:
        # transformers TopPLogitsWarper: drop the smallest tokens whose cumulative mass <= 1 - top_p,
        # always keeping the most likely one.
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - params.top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    if params.top_k > 0:
        k = min(params.top_k, x.shape[-1])
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if params.min_p > 0:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    return x


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed target distribution [..., V] (fp32) that acceptance and the bonus use."""
    return torch.softmax(process_logits(logits, params), dim=-1)


def round_generator(seed: int, round_index: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for round `round_index` (0 = prefill) of a sequence seeded with `seed`, on
    `device`: the device of the probabilities it will draw from (a CPU generator cannot draw from
    CUDA probabilities). The two integers are hashed so nearby seeds and rounds give unrelated
    streams. The same (seed, round, device type) replays the same draws; CPU and CUDA generators
    are different streams, so a run replays on the device type it ran on."""
    digest = hashlib.sha256(f"aerie:{seed}:{round_index}".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return g


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator) -> float:
    """A uniform draw in [0, 1) in float64."""
    return float(torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device).item())


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's own next token from logits [V]: argmax when greedy, else a processed sample."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    assert generator is not None
    return sample(target_probs(logits, params), generator)
