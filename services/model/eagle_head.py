"""EAGLE draft heads in the published checkpoint formats (eagle.md section 1).

Two heads share one interface (`DraftHead`), which the tree builder drives:

    head.forward(features [T, F], ids [T], cache, positions, tree_mask) -> out [T, H]
    head.log_probs(out [N, H]) -> [N, V_draft]   fp32 log-softmax over the draft vocabulary
    head.to_target(draft_ids) -> target ids       (identity unless EAGLE-3 d2t is present)

* `Eagle2Head` (EAGLE-1/2): x = fc([embed(ids), feature]) -> one decoder layer with no input norm;
  logits come from the *target's* lm_head, no final norm. Feature = the target's post-norm hidden.
* `Eagle3Head`: h = fc(3 fused target taps) (or the head's own previous output inside the tree);
  attention reads [input_layernorm(embed), hidden_norm(h)] (2H); residual is the un-normalised h;
  logits = own lm_head(norm(x)) over a reduced draft vocabulary mapped back with d2t.

State-dict keys are the reference's (`fc.weight`, `layers.0.self_attn.q_proj.weight`,
`midlayer.hidden_norm.weight`, `d2t`, ...); `checkpoint.py` loads and saves them. This module does
not build trees or read files.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from services.model.config import rope_inv_freq
from services.model.kv_cache import KVCache
from services.model.layers import MLP, Attention, RMSNorm, Rotary, attention_mask
from services.model.linear import Linear

HeadKind = Literal["eagle", "eagle3"]


@dataclass(frozen=True, slots=True)
class HeadConfig:
    kind: HeadKind
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    vocab_size: int  # target vocabulary (embedding rows)
    rope_theta: float = 10000.0  # the draft config's own rope_theta, else 10000 (never the target's)
    rope_scaling: dict | None = None  # only {"rope_type": "linear", "factor": f}
    fc_bias: bool = True  # EAGLE-1/2 `bias` field (default True; LLaMA3 heads set false)
    qkv_bias: bool = False
    draft_vocab_size: int | None = None  # EAGLE-3 reduced vocabulary
    target_hidden_size: int | None = None  # EAGLE-3 fc input is 3 * this (default hidden_size)
    max_position_embeddings: int = 2048  # informational: RoPE is computed for any position

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes."""
        if self.kind == "eagle":
            return self.hidden_size
        return 3 * (self.target_hidden_size or self.hidden_size)

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class DraftHead(nn.Module, metaclass=ABCMeta):
    """Common parts: embedding, RoPE, the draft KV cache and the level-by-level forward."""

    config: HeadConfig
    feature_kind: Literal["hidden", "taps"]

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen copy of the target's embedding
        self.rotary = Rotary(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def forward(self, features: torch.Tensor, ids: torch.Tensor, cache: KVCache,
                positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """features [T, F]; ids [T]; tree_mask [T, T'] over the last T' key rows (None = causal).
        Returns the predicted next features [T, H]. WARNING: mutates `cache` (appends T rows)."""
        t = ids.shape[0]
        cache.reserve(t)
        prefix = cache.length
        if positions is None:
            positions = torch.arange(prefix, prefix + t, device=ids.device)
        mask = attention_mask(prefix, t, tree_mask, self.device)
        cos, sin = self.rotary(positions, self.dtype)
        out = self._layer(features.to(self.dtype), self.embed_tokens(ids), cos, sin, cache, mask)
        cache.advance(t)
        return out

    @abstractmethod
    def _layer(self, features, emb, cos, sin, cache, mask) -> torch.Tensor:
        """The head's one decoder layer: [T, F] features, [T, H] embeddings -> [T, H]."""

    @abstractmethod
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> [N, V_draft] logits."""

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """out [N, H] -> [N, V_draft] fp32 log-probabilities (the reference's LogSoftmax)."""
        return F.log_softmax(self.logits(out).float(), dim=-1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class Eagle2Head(DraftHead):
    """EAGLE-1/2 head. `lm_head` is the target's, held by reference (not in this state dict)."""

    feature_kind = "hidden"

    def __init__(self, cfg: HeadConfig, target_lm_head: nn.Module) -> None:
        super().__init__(cfg)
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([_Eagle2Layer(cfg)])
        self._target_head = (target_lm_head,)  # a tuple keeps it out of parameters/state_dict

    def _layer(self, features, emb, cos, sin, cache, mask):
        layer = self.layers[0]
        x = self.fc(torch.cat((emb, features), dim=-1))  # order [embedding, feature]; no activation
        x = x + layer.self_attn(x, cos, sin, cache, 0, mask)  # layer 0 has no input_layernorm
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self._target_head[0](out)  # no final norm


class _Eagle2Layer(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


class Eagle3Head(DraftHead):
    feature_kind = "taps"

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        h = cfg.hidden_size
        self.fc = Linear(cfg.feature_size, h, bias=False)
        self.midlayer = _Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab, bias=False)
        if cfg.draft_vocab != cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None  # the reference deletes d2t/t2d when the vocabularies are equal

    def _layer(self, features, emb, cos, sin, cache, mask):
        m = self.midlayer
        # fc only on the fused 3H target taps; tree steps feed the head's own H-dim outputs
        h = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        a = torch.cat((m.input_layernorm(emb), m.hidden_norm(h)), dim=-1)  # [T, 2H]
        x = h + m.self_attn(a, cos, sin, cache, 0, mask)  # residual: un-normalised h
        return x + m.mlp(m.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


def build_head(cfg: HeadConfig, target_lm_head: nn.Module | None = None) -> DraftHead:
    if cfg.kind == "eagle":
        assert target_lm_head is not None, "an EAGLE-1/2 head needs the target's lm_head"
        return Eagle2Head(cfg, target_lm_head)
    return Eagle3Head(cfg)
