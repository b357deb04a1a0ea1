"""Building blocks shared by the target model and the EAGLE heads: RMSNorm, RoPE, attention over a
KVCache with an explicit boolean mask, and the gated MLP.

State-dict names follow Hugging Face Llama (`q_proj`, `gate_proj`, ...) so checkpoints load by name,
but q/k/v and gate/up run as one GEMM each: `qkv_proj` and `gate_up_proj` are `PackedLinear`s that
keep their split sizes and part names (linear.py), so a tensor-parallel transform can still slice
each projection (column-parallel: qkv_proj, gate_up_proj; row-parallel: o_proj, down_proj). Numerics follow
transformers: RMSNorm in fp32 then cast back, RoPE cos/sin computed in fp32 and cast to the
activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from services.model import fused
from services.model.attention import attend, attend_gathered
from services.model.kv_cache import KVRows
from services.model.linear import Linear, PackedLinear, keep_part_names


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin for absolute positions from fixed inverse frequencies [head_dim/2].

    The tables for positions [0, n) are computed once per dtype and grown by doubling, then indexed
    (values identical to computing them per call: the same fp32 products, cos and sin)."""

    inv_freq: torch.Tensor  # [head_dim/2] fp32, a non-persistent buffer

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim]. `upto`: a bound the caller knows on the host
        (every position < upto), so that a positions tensor on a GPU is never read back (a host
        synchronisation); without it the tables grow to positions.max() + 1."""
        if torch.is_grad_enabled() or positions.numel() == 0 or self.inv_freq.is_meta:
            return self.table(positions, dtype)
        need = upto if upto is not None else int(positions.max()) + 1
        cos, sin = self.tables(need, dtype, positions.device)
        return cos[positions], sin[positions]

    def tables(self, need: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] for positions [0, n), n >= need (grown by doubling, at least 512)."""
        cached = self._tables.get(dtype)
        if cached is None or cached[0].shape[0] < need or cached[0].device != device:
            n = max(need, 2 * cached[0].shape[0] if cached is not None else 512)
            cached = self.table(torch.arange(n, device=self.inv_freq.device), dtype)
            self._tables[dtype] = cached
        return cached

    def _apply(self, fn, recurse=True):  # .to()/.float() move inv_freq: drop the tables
        self._tables = {}
        return super()._apply(fn, recurse)


def host_bound(positions: torch.Tensor, bound: int) -> int | None:
    """`bound` (every position < bound, known on the host) for positions on a GPU, where reading
    their maximum would synchronise; None on the CPU, where the maximum is read (free, and exact for
    callers that pass positions of their own)."""
    return bound if positions.device.type == "cuda" else None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, T, hd] with cos, sin [T, hd]; or x [T, heads, hd] with cos, sin [T, 1, hd]
    return fused.rotary(x, cos, sin)


@dataclass(frozen=True, slots=True)
class BatchKV:
    """Where the rows of a batched forward go: rows [offsets[i], offsets[i+1]) of the input belong
    to a sequence with KV `caches[i]` and attention mask `masks[i]` (as `attention_mask` builds it,
    None = causal without a dense mask)."""
    caches: list[KVRows]
    masks: list[torch.Tensor | None]
    offsets: list[int]  # len(caches) + 1


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, reading and writing a KVCache layer.

    `in_dim` differs from `hidden` only for the EAGLE-3 head (its q/k/v read 2H)."""

    def __init__(self, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = PackedLinear(in_dim, (q, kv, kv), ("q_proj", "k_proj", "v_proj"), bias=qkv_bias)
        self.o_proj = Linear(q, hidden, bias=o_bias)
        keep_part_names(self, "qkv_proj")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVRows | BatchKV,
                layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        """x [T, in_dim]; mask [T, cache.length + T] bool (True = may attend), or None when every
        new row sees every cached row and the new rows are causal among themselves (T == 1, or a
        prefill into an empty cache) -> [T, hidden]. A `BatchKV` instead of a cache: many
        sequences' rows in x, each with its own cache and mask (`mask` unused), see forward_batch."""
        if isinstance(cache, BatchKV):
            return self.forward_batch(x, cos, sin, cache.caches, layer, cache.masks, cache.offsets)
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, cache, layer, mask))

    def forward_batch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      caches: list[KVRows], layer: int, masks: list[torch.Tensor | None],
                      offsets: list[int]) -> torch.Tensor:
        """Many sequences in one pass: x [R, in_dim] holds entry i's rows at [offsets[i],
        offsets[i+1]); the q/k/v and output projections and RoPE run once over all R rows,
        attention runs per entry against its own cache with its own mask (as `forward`) -> [R, hidden]."""
        qkv = self.qkv_proj(x)
        if len(caches) == 1:
            out = self.attend(qkv, cos, sin, caches[0], layer, masks[0])
        else:
            q, k, v = self.rotated(qkv, cos, sin)
            out = torch.cat([self.attend_rotated(q[a:b], k[a:b], v[a:b], cache, layer, mask)
                             for cache, mask, (a, b) in zip(caches, masks, pairwise(offsets), strict=True)])
        return self.o_proj(out)

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVRows,
               layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        """qkv [T, q+k+v] (the packed projection of T new rows) -> attention output [T, heads*hd];
        writes the rows' K/V into `cache` at its next free rows (not advancing its length)."""
        return self.attend_rotated(*self.rotated(qkv, cos, sin), cache, layer, mask)

    def rotated(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, q+k+v], cos/sin [T, hd] -> q [T, heads, hd], k and v [T, kv_heads, hd], RoPE
        applied to q and k (elementwise per row: the same values for a row alone or in a batch)."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, None], sin[:, None]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVRows, layer: int,
                       mask: torch.Tensor | None) -> torch.Tensor:
        """q [T, heads, hd], k/v [T, kv_heads, hd] (rotated) -> [T, heads*hd]; writes k/v into `cache`."""
        t = q.shape[0]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        prefix = cache.length
        k_all, v_all = cache.write(layer, k, v)  # [nKV, S, hd], S = length + T
        if k_all.dim() == 4:  # B sequences' rows, each over its own S keys [nKV, B, S, hd]; mask [B, T/B, S]
            assert mask is not None  # (the static draft of a batch: services/spec/tree_static.py)
            b, h = k_all.shape[1], q.shape[0]
            qb = q.reshape(h, b, t // b, self.head_dim).transpose(0, 1)  # [B, H, T/B, hd]
            out = attend_gathered(qb, k_all, v_all, mask).transpose(0, 1).reshape(h, t, self.head_dim)
            return out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim)
        if mask is None:
            assert t == 1 or prefix == 0, "a maskless forward needs T == 1 or an empty cache"
        out = attend(q, k_all, v_all, mask, causal=mask is None and t > 1)  # [H, T, hd]
        return out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden, (intermediate, intermediate), ("gate_proj", "up_proj"), bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        keep_part_names(self, "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(fused.silu_mul(gate, up))


def attention_mask(prefix_len: int, num_new: int, tree_mask: torch.Tensor | None,
                   device: torch.device | str = "cpu", allow_none: bool = False) -> torch.Tensor | None:
    """Boolean mask [T, prefix_len + T]: every new row sees the whole cached prefix, and among the
    new rows either the causal triangle (tree_mask None) or `tree_mask` [T, T'] applied to the
    last T' key columns (T' >= T: the draft's tree levels see earlier levels' rows).

    Example: prefix 2, tree rows root r, children a, b of r:
        tree_mask = [[1,0,0],[1,1,0],[1,0,1]] -> rows r: 11 100, a: 11 110, b: 11 101.

    allow_none: return None instead of a dense mask when none is needed: causal (no tree mask) and
    either one new row (plain decode) or an empty prefix (prefill; SDPA's `is_causal`)."""
    if allow_none and tree_mask is None and (num_new == 1 or prefix_len == 0):
        return None
    mask = torch.ones(num_new, prefix_len + num_new, dtype=torch.bool, device=device)
    if tree_mask is None:
        mask[:, prefix_len:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    else:
        cols = tree_mask.shape[-1]
        mask[:, prefix_len + num_new - cols:] = tree_mask.to(device=device, dtype=torch.bool)
    return mask
