"""The native Llama-family target model: one forward for prefill, plain decode and tree verification.

    TargetModel.forward(input_ids [T], cache, positions [T] | None, tree_mask [T, T] | None)
      -> TargetOutput(logits, hidden, taps)

The new tokens attend to every cached row plus, among themselves, the causal triangle (prefill,
decode) or a tree mask (verification: each node sees the prefix and its own ancestors). Their K/V are
written at the cache's next free slots; `KVCache.keep` later compacts an accepted path.

It returns what an EAGLE head needs: `hidden`, the post-final-norm last hidden state (EAGLE-1/2
feature = the lm_head input), and `taps`, the residual stream entering layers 2, N//2 and N-3
concatenated low->mid->high (EAGLE-3). It does not sample, build trees or know about heads.
State-dict keys are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from services.model.config import ModelConfig, rope_inv_freq
from services.model.kv_cache import KVCache
from services.model.layers import MLP, Attention, RMSNorm, Rotary, attention_mask
from services.model.linear import Linear, freeze_linears, parse_layout


@dataclass(frozen=True, slots=True)
class TargetOutput:
    logits: torch.Tensor  # [T, V] fp32, or [1, V] when only the last row was asked for
    hidden: torch.Tensor  # [T, H] post-final-norm features (EAGLE-1/2)
    taps: torch.Tensor | None  # [T, 3H] pre-norm residuals entering layers 2, N//2, N-3 (EAGLE-3)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.qkv_bias, cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    def freeze_layout(self, layout: str = "transposed") -> None:
        """Inference weight layout of the linears (linear.py `parse_layout`): "BODY" for all, or
        "BODY/HEAD" with the lm_head's own, e.g. "transposed/both:2". A tied lm_head in a layout
        other than "hf" stops sharing the embedding's tensor (the embedding keeps [V, H])."""
        body, _, head = layout.partition("/")
        head = head or body
        if self.config.tie_word_embeddings and parse_layout(head)[0] != "hf":
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach(), requires_grad=False)
        freeze_linears(self.model, body)
        freeze_linears(self.lm_head, head)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config  # KV heads of this model's layers: fewer than the config's on a tensor-parallel shard
        return KVCache(c.num_layers, self.model.layers[0].self_attn.num_kv_heads, c.head_dim, capacity,
                       self.dtype, self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits_for: Literal["all", "last"] = "all",
                want_taps: bool = False) -> TargetOutput:
        """input_ids [T]; positions [T] absolute (default: cache.length + arange(T));
        tree_mask [T, T] bool ancestors-or-self (None = causal).
        WARNING: mutates `cache` (writes T rows, advances its length)."""
        t = input_ids.shape[0]
        cache.reserve(t)
        prefix = cache.length
        if positions is None:
            positions = torch.arange(prefix, prefix + t, device=input_ids.device)
        mask = attention_mask(prefix, t, tree_mask, self.device, allow_none=True)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        taps: list[torch.Tensor] = []
        tap_layers = self.config.eagle3_tap_layers if want_taps else ()
        for i, layer in enumerate(self.model.layers):
            if i in tap_layers:
                taps.append(x)
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, cache, i, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.advance(t)
        hidden = self.model.norm(x)
        rows = hidden if logits_for == "all" else hidden[-1:]
        logits = self.lm_head(rows).float()
        return TargetOutput(logits=logits, hidden=hidden,
                            taps=torch.cat(taps, dim=-1) if want_taps else None)
