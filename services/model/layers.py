"""Building blocks shared by the target model and the EAGLE heads: RMSNorm, RoPE, attention over a
KVCache with an explicit boolean mask, and the gated MLP.

Parameter names follow Hugging Face Llama (`q_proj`, `gate_proj`, ...) so checkpoints load by name and
a tensor-parallel transform can find the column- and row-parallel linears. Numerics follow
transformers: RMSNorm in fp32 then cast back, RoPE cos/sin computed in fp32 and cast to the
activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Rotary(nn.Module):
    """cos/sin for absolute positions from fixed inverse frequencies [head_dim/2]."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, T, hd]; cos, sin [T, hd]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, reading and writing a KVCache layer.

    `in_dim` differs from `hidden` only for the EAGLE-3 head (its q/k/v read 2H)."""

    def __init__(self, in_dim: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layer: int, mask: torch.Tensor) -> torch.Tensor:
        """x [T, in_dim]; mask [T, cache.length + T] bool (True = may attend) -> [T, hidden]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_all, v_all = cache.write(layer, k, v)  # [nKV, S, hd], S = length + T
        out = F.scaled_dot_product_attention(
            q[None], k_all[None], v_all[None], attn_mask=mask[None, None],
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out[0].transpose(0, 1).reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def attention_mask(prefix_len: int, num_new: int, tree_mask: torch.Tensor | None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask [T, prefix_len + T]: every new row sees the whole cached prefix, and among the
    new rows either the causal triangle (tree_mask None) or `tree_mask` [T, T'] applied to the
    last T' key columns (T' >= T: the draft's tree levels see earlier levels' rows).

    Example: prefix 2, tree rows root r, children a, b of r:
        tree_mask = [[1,0,0],[1,1,0],[1,0,1]] -> rows r: 11 100, a: 11 110, b: 11 101."""
    mask = torch.ones(num_new, prefix_len + num_new, dtype=torch.bool, device=device)
    if tree_mask is None:
        mask[:, prefix_len:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    else:
        cols = tree_mask.shape[-1]
        mask[:, prefix_len + num_new - cols:] = tree_mask.to(device=device, dtype=torch.bool)
    return mask
