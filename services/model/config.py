"""Target-model configuration: one validated dataclass read from a Hugging Face ``config.json``.

Covers the Llama family as aerie implements it: Llama 2/3/3.1 (llama3 RoPE scaling), Mistral,
Qwen2 (q/k/v bias) and SmolLM2 (tied embeddings). It knows nothing about weights or files beyond the
config dict; ``loading.py`` reads the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from services.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama `attention_bias`: bias on o_proj too
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", ...}
    sliding_window: int | None = None  # Mistral v0.1; contexts are capped to it (see max_context)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise CheckpointError(f"config {name} must be >= 1; got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def max_context(self) -> int:
        """Longest sequence served exactly (sliding-window attention is not implemented, so a
        Mistral-v0.1 style window caps the context instead of silently changing the math)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def eagle3_tap_layers(self) -> tuple[int, int, int]:
        """Decoder-layer indices whose *input* residual EAGLE-3 fuses: 2, N//2, N-3 (eagle.md 1.2)."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        model_type = d.get("model_type", "")
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = SUPPORTED_ARCHITECTURES[a]
        if arch is None and model_type in ("llama", "mistral", "qwen2"):
            arch = model_type
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or model_type!r}; aerie supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type llama, mistral, qwen2)")
        try:
            hidden = int(d["hidden_size"])
            n_heads = int(d["num_attention_heads"])
            head_dim = d.get("head_dim") or hidden // n_heads
            rope_theta, rope_scaling = _rope_from_hf(d)
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            sliding = d.get("sliding_window") if arch in ("mistral", "qwen2") else None
            # Qwen2 slides only with use_sliding_window, and only in layers >= max_window_layers
            if arch == "qwen2" and (not d.get("use_sliding_window", False)
                                    or int(d.get("max_window_layers") or 0) >= int(d["num_hidden_layers"])):
                sliding = None
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
                o_bias=arch != "qwen2" and bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                rope_scaling=rope_scaling,
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing the field {e.args[0]!r}") from None


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either the transformers<5 fields (`rope_theta`, `rope_scaling`)
    or the transformers>=5 `rope_parameters` dict."""
    params = d.get("rope_parameters")
    scaling: dict | None
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    if scaling is not None:
        scaling.pop("rope_theta", None)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    return theta, scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2] in fp32, with linear or llama3 scaling applied.

    Matches transformers' `_compute_default/linear/llama3_parameters`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise CheckpointError(f"rope scaling type {kind!r} is not supported")
