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

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, cast

import torch
from torch import nn

from services.model.config import ModelConfig, rope_inv_freq
from services.model.kv_cache import KVCache, KVRows
from services.model.layers import MLP, Attention, RMSNorm, Rotary, attention_mask, host_bound
from services.model.linear import Linear, freeze_linears, parse_layout
from services.model.step import Step, StepEntry, StepOutput


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

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` with their type (nn.ModuleList is not generic); the same list, not a copy."""
        return cast("Sequence[DecoderLayer]", self.layers)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.model.embed_tokens.weight)  # (a Parameter)
        self.rotary = Rotary(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        self.layout = "hf"  # the linears' inference layout (freeze_layout)

    def freeze_layout(self, layout: str = "transposed", lm_head_only: bool = False) -> None:
        """Inference weight layout of the linears (linear.py `parse_layout`): "BODY" for all, or
        "BODY/HEAD" with the lm_head's own, e.g. "transposed/both:2". A tied lm_head in a layout
        other than "hf" stops sharing the embedding's tensor (the embedding keeps [V, H]).
        `lm_head_only`: the lm_head alone (a model whose body was never loaded: load_head_anchors)."""
        body, _, head = layout.partition("/")
        head = head or body
        self.layout = layout  # part of the budget's cost-calibration key
        if self.config.tie_word_embeddings and parse_layout(head)[0] != "hf":
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.detach(), requires_grad=False)
        if not lm_head_only:
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
        return KVCache(c.num_layers, self.model.decoder_layers[0].self_attn.num_kv_heads, c.head_dim, capacity,
                       self.dtype, self.device)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: KVRows, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits_for: Literal["all", "last"] = "all",
                want_taps: bool = False) -> TargetOutput:
        """input_ids [T]; positions [T] absolute (default: cache.length + arange(T));
        tree_mask [T, T] bool ancestors-or-self (None = causal).
        WARNING: mutates `cache` (writes T rows, advances its length)."""
        step = Step((StepEntry(0, input_ids, positions, tree_mask, logits_for),), want_taps)
        out = self.forward_step(step, [cache])
        return TargetOutput(logits=out.logits[0], hidden=out.hidden, taps=out.taps)

    @torch.no_grad()
    def forward_step(self, step: Step, caches: list[KVRows]) -> StepOutput:
        """One forward over every entry of `step`; caches[i] is entry i's KV (its slot). All R rows
        go through each linear layer as one GEMM; attention runs per entry against its own cache.
        WARNING: mutates every cache (writes the entry's rows, advances its length). Reserve first:
        a cache that cannot take its rows raises CapacityExceeded before anything is written."""
        assert len(caches) == len(step.entries), (len(caches), len(step.entries))
        for e, cache in zip(step.entries, caches, strict=True):
            cache.reserve(e.rows)
        device = self.device
        offsets = [0]
        for e in step.entries:
            offsets.append(offsets[-1] + e.rows)
        ids, pos, masks = [], [], []
        for e, cache in zip(step.entries, caches, strict=True):
            prefix = cache.length
            ids.append(e.input_ids.to(device))
            pos.append(e.positions.to(device) if e.positions is not None
                       else torch.arange(prefix, prefix + e.rows, device=device))
            masks.append(attention_mask(prefix, e.rows, e.tree_mask, device, allow_none=True))
        input_ids = ids[0] if len(ids) == 1 else torch.cat(ids)
        positions = pos[0] if len(pos) == 1 else torch.cat(pos)
        x = self.model.embed_tokens(input_ids)
        bound = max(cache.length + e.rows for e, cache in zip(step.entries, caches, strict=True))
        cos, sin = self.rotary(positions, x.dtype, host_bound(positions, bound))
        taps: list[torch.Tensor] = []
        tap_layers = self.config.eagle3_tap_layers if step.want_taps else ()
        for i, layer in enumerate(self.model.decoder_layers):
            if i in tap_layers:
                taps.append(x)
            x = x + layer.self_attn.forward_batch(layer.input_layernorm(x), cos, sin, caches, i, masks, offsets)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for e, cache in zip(step.entries, caches, strict=True):
            cache.advance(e.rows)
        hidden = self.model.norm(x)
        # one lm_head GEMM over the rows that want logits
        if all(e.logits == "all" for e in step.entries):
            rows = hidden
            counts = [e.rows for e in step.entries]
        else:
            picks = [torch.arange(a, b, device=device) if e.logits == "all" else torch.tensor([b - 1], device=device)
                     for e, (a, b) in zip(step.entries, pairwise(offsets), strict=True)]
            counts = [int(p.numel()) for p in picks]
            rows = hidden[picks[0][0]:picks[0][-1] + 1] if len(picks) == 1 else hidden[torch.cat(picks)]
        logits = self.lm_head(rows).float()
        per_entry = logits.split(counts) if len(counts) > 1 else (logits,)
        return StepOutput(logits=tuple(per_entry), hidden=hidden,
                          taps=torch.cat(taps, dim=-1) if step.want_taps else None, offsets=tuple(offsets))
