"""EAGLE draft heads in the published checkpoint formats (eagle.md section 1).

Two heads share one interface (`DraftHead`), which the tree builder drives:

    head.forward(features [T, F], ids [T], cache, positions, tree_mask) -> out [T, H]
    head.log_probs(out [N, H]) -> [N, V_draft]   fp32 log-softmax over the draft vocabulary
    head.to_target(draft_ids) -> target ids       (identity unless a d2t map is present)

Reduced draft vocabulary (FR-Spec, one code path for both kinds): `restrict_vocab(counts, K)` keeps
the K most frequent tokens of the head's own projection (the target's lm_head rows for EAGLE-1/2,
the head's lm_head rows for EAGLE-3) in a small owned projection `vocab_proj` [K, H] and maps draft
ids back with the EAGLE-3 convention `target = draft + vocab_d2t[draft]`. `set_draft_dtype` runs the
head in bf16 or with int8 linears. Neither changes the state dict (checkpoints stay as published).

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
from itertools import pairwise
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.model.config import rope_inv_freq
from services.model.head_kind import HeadKind
from services.model.kv_cache import KVCache, KVRows
from services.model.layers import MLP, Attention, BatchKV, RMSNorm, Rotary, attention_mask, host_bound
from services.model.linear import Linear


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
        self.vocab_proj: nn.Module | None = None  # owned [K, H] projection once restricted / recast
        self.register_buffer("vocab_d2t", None, persistent=False)  # [K] int64, target = i + d2t[i]
        self.token_counts: torch.Tensor | None = None  # [V] int64 frequency ranking (draft_vocab.py)
        self.draft_dtype = "fp32"
        self.register_state_dict_post_hook(_drop_derived)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def feature_dtype(self) -> torch.dtype:
        """The dtype the target's features arrive in (the head's load dtype, before
        set_draft_dtype); forward casts them to the head's own."""
        return getattr(self, "_feature_dtype", None) or self.dtype

    @property
    def draft_vocab_size(self) -> int:
        """Rows of the distribution `log_probs` returns (K once restricted)."""
        if self.vocab_d2t is not None:
            return int(self.vocab_d2t.shape[0])
        return self.config.draft_vocab

    @abstractmethod
    def _projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full draft projection: (weight [Vd, H], target id of each row [Vd] ascending)."""

    def restrict_vocab(self, counts: torch.Tensor, k: int) -> None:
        """Project only onto the K rows of the current projection whose target tokens are the most
        frequent in `counts` [V] (ties: lower id). K >= the current size leaves the head unchanged.
        Call after loading and before `set_draft_dtype`."""
        weight, target_ids = self._projection()
        if not 1 <= k:
            raise ValueError(f"draft vocabulary size must be >= 1; got {k}")
        if k >= weight.shape[0]:
            return
        rank = torch.sort(-counts.long()[target_ids.cpu()], stable=True).indices  # ties: lower id
        keep = torch.sort(rank[:k]).values.to(weight.device)
        used = target_ids[keep]
        proj = Linear(weight.shape[1], k, bias=False).to(device=weight.device, dtype=weight.dtype)
        proj.weight = nn.Parameter(weight.detach()[keep].clone(), requires_grad=False)
        self.vocab_proj = proj
        self.vocab_d2t = used.long() - torch.arange(k, device=used.device)

    def set_draft_dtype(self, draft_dtype: str) -> None:
        """"fp32" | "bf16" | "int8" (dynamic int8 linears, fp32 activations). Inference only; an
        EAGLE-1/2 head gets its own copy of the target's projection when its dtype would differ."""
        if draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft dtype must be one of {sorted(DRAFT_DTYPES)}; got {draft_dtype!r}")
        if draft_dtype == "fp32" and self.dtype == torch.float32:
            return
        self._feature_dtype = self.feature_dtype
        if self.vocab_proj is None and isinstance(self, Eagle2Head):
            weight, _ = self._projection()
            proj = Linear(weight.shape[1], weight.shape[0], bias=False)
            proj.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
            self.vocab_proj = proj.to(weight.device)
        if draft_dtype == "int8":
            from services.model.quant import quantize_linears
            self.float()
            for name, child in list(self.named_children()):
                if name != "embed_tokens":
                    setattr(self, name, quantize_linears(child))
        else:
            self.to(DRAFT_DTYPES[draft_dtype])
        self.draft_dtype = draft_dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def forward(self, features: torch.Tensor, ids: torch.Tensor, cache: KVRows,
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
        cos, sin = self.rotary(positions, self.dtype, host_bound(positions, prefix + t))
        out = self._layer(features.to(self.dtype), self.embed_tokens(ids), cos, sin, cache, mask)
        cache.advance(t)
        return out

    def forward_batch(self, features: torch.Tensor, ids: torch.Tensor, caches: list[KVRows],
                      positions: torch.Tensor, masks: list[torch.Tensor | None], offsets: list[int]
                      ) -> torch.Tensor:
        """Many sequences in one head step: rows [offsets[i], offsets[i+1]) of features [R, F],
        ids [R] and positions [R] belong to the sequence with draft KV caches[i] and tree mask
        masks[i] ([T_i, T_i'] over its last T_i' key rows, None = causal). Every linear runs once
        over all R rows; attention runs per sequence. -> [R, H].
        WARNING: mutates every cache (appends its rows)."""
        if len(caches) == 1:
            a, b = offsets[0], offsets[1]
            return self(features[a:b], ids[a:b], caches[0], positions[a:b], masks[0])
        sizes = [b - a for a, b in pairwise(offsets)]
        for cache, t in zip(caches, sizes, strict=True):
            cache.reserve(t)
        dense = [attention_mask(cache.length, t, m, self.device)
                 for cache, t, m in zip(caches, sizes, masks, strict=True)]
        bound = max(cache.length + t for cache, t in zip(caches, sizes, strict=True))
        cos, sin = self.rotary(positions, self.dtype, host_bound(positions, bound))
        out = self._layer(features.to(self.dtype), self.embed_tokens(ids), cos, sin,
                          BatchKV(caches, dense, list(offsets)), None)
        for cache, t in zip(caches, sizes, strict=True):
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
        if self.vocab_d2t is not None:
            return draft_ids + self.vocab_d2t[draft_ids]
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
        layer = cast(_Eagle2Layer, self.layers[0])
        x = self.fc(torch.cat((emb, features), dim=-1))  # order [embedding, feature]; no activation
        x = x + layer.self_attn(x, cos, sin, cache, 0, mask)  # layer 0 has no input_layernorm
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.vocab_proj is not None:
            return self.vocab_proj(out)  # no final norm
        return self._target_head[0](out)

    def _projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.vocab_proj is not None:
            return _weight(self.vocab_proj), self.to_target(torch.arange(self.draft_vocab_size, device=self.device))
        w = _weight(self._target_head[0])
        return w, torch.arange(w.shape[0], device=w.device)


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
        return (self.vocab_proj if self.vocab_proj is not None else self.lm_head)(self.norm(out))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_d2t is not None:
            return draft_ids + self.vocab_d2t[draft_ids]
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def _projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = _weight(self.vocab_proj if self.vocab_proj is not None else self.lm_head)
        return w, self.to_target(torch.arange(w.shape[0], device=self.device))


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


DRAFT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}


def _drop_derived(module, state, prefix, local_metadata) -> None:
    """The reduced / recast projection is derived at load time: never part of a checkpoint."""
    for key in [k for k in state if k.startswith(prefix + "vocab_proj.")]:
        del state[key]


def _weight(projection: nn.Module) -> torch.Tensor:
    """A projection's [V, H] weight: a Linear's (an int8 QuantLinear keeps none; `_projection` runs
    before `set_draft_dtype`)."""
    w = projection.weight
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"the draft projection {type(projection).__name__} has no weight tensor")
    return w


def build_head(cfg: HeadConfig, target_lm_head: nn.Module | None = None) -> DraftHead:
    if cfg.kind == "eagle":
        assert target_lm_head is not None, "an EAGLE-1/2 head needs the target's lm_head"
        return Eagle2Head(cfg, target_lm_head)
    return Eagle3Head(cfg)
