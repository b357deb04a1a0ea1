"""Paged attention: a Triton kernel that reads each sequence's keys in place from the paged arena.

    out = paged_attention(q, k, v, row_table, prefix, tree, scale)        # [B, T, H, hd], q's dtype

    q          [B, T, H, hd]   the step's queries (B sequences x T rows; RoPE applied)
    k, v       [nKV, rows, hd] one layer's arena (services/model/paged_kv.py)
    row_table  [B, S] int64    arena row of each of a sequence's S key slots
    prefix     [B] int64       committed rows of each sequence (its slots [0, prefix))
    tree       [B, T, T]       0/1 (int64 or bool): new row t sees new row j iff tree[b, t, j]

Key slot r is visible to row t of sequence b when r < prefix[b] (committed) or prefix[b] <= r <
prefix[b] + T and tree[b, t, r - prefix[b]] (uniform.py's `key_mask`, computed on the fly). Every row
must see at least itself. Query head h reads KV head h // G (G = H / nKV).

How (flash-decoding): one program per (sequence, KV head, block of query rows, key split). The G*T
query rows of one KV head (row m = t*G + g) form one block, so each key block is loaded once for
all of them, up to MAX_BLOCK_M rows (a 64-row tree with G = 4 is 4 blocks, each reading the keys,
the later ones mostly from L2); the keys come through `row_table` (no gather copy). The number of slots a sequence
needs, min(prefix + T, S), is read from `prefix` inside the kernel, which loops over those blocks
only: a short sequence padded to S slots costs its own length. Scores and the online softmax are
fp32; fp32 inputs use IEEE dot products (no TF32). When B * nKV programs would leave the GPU's SMs
idle, the key range of each sequence is split across `splits` programs (each takes 1/splits of the
sequence's own length) and a second kernel merges their (output, log-sum-exp) pairs. The grid and
`splits` depend only on the shapes (B, T, S, H, nKV) and the device: nothing is read back to the
host, so the call is CUDA-graph capturable.

Needs `triton`. On the CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1 set before
triton is imported; the tests do this): slow, for correctness checks. Does not write K/V (the
caller's index_copy does), does not know about pages (only arena rows).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # key slots per loop iteration
MAX_BLOCK_M = 64  # query rows (of one KV head) per program
MAX_SPLITS = 32
# Triton decides when a kernel is decorated (this module's import) whether it runs interpreted
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def _attend_kernel(Q, K, V, RowTable, Prefix, Tree, Out, Lse, scale_log2,
                   stride_qb, stride_qt, stride_qh,
                   stride_kh, stride_kr, stride_vh, stride_vr,
                   stride_ob, stride_ot, stride_oh, stride_os,
                   S, NKV: tl.constexpr, T: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
                   SPLITS: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(0)  # b * NKV + kv head
    pid_m = tl.program_id(1)  # block of query rows
    pid_s = tl.program_id(2)  # key split
    b = pid_bh // NKV
    kvh = pid_bh % NKV
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query row m = t*G + g of this KV head
    t_m = offs_m // G
    h_m = kvh * G + offs_m % G
    m_ok = offs_m < G * T
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    q = tl.load(Q + b * stride_qb + t_m[:, None] * stride_qt + h_m[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    prefix = tl.load(Prefix + b)
    n_keys = tl.minimum(prefix + T, S)  # slots this sequence needs (a device value)
    per_split = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK_N) * BLOCK_N
    lo = pid_s * per_split
    hi = tl.minimum(lo + per_split, n_keys)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        rows = tl.load(RowTable + b * S + offs_n, mask=n_ok, other=0)  # arena rows of these slots
        k = tl.load(K + kvh * stride_kh + rows[:, None] * stride_kr + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2  # [BLOCK_M, BLOCK_N] fp32, log2 units
        rel = offs_n - prefix  # position among the step's new rows
        in_tree = (rel >= 0) & (rel < T) & n_ok
        seen = tl.load(Tree + b * T * T + t_m[:, None] * T + rel[None, :],
                       mask=m_ok[:, None] & in_tree[None, :], other=0)
        visible = ((offs_n < prefix) & n_ok)[None, :] | (seen != 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kvh * stride_vh + rows[:, None] * stride_vr + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptr = (Out + b * stride_ob + t_m[:, None] * stride_ot + h_m[:, None] * stride_oh + pid_s * stride_os
             + offs_d[None, :])
    tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if SPLITS > 1:  # this split's log-sum-exp (log2 units; -inf when it saw no key)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(Lse + ((b * T + t_m) * (NKV * G) + h_m) * SPLITS + pid_s, lse, mask=m_ok)


@triton.jit
def _merge_kernel(Part, Lse, Out, SPLITS: tl.constexpr, HD: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # (b * T + t) * H + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < SPLITS
    lse = tl.load(Lse + row * SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # every row saw itself: some split is finite
    part = tl.load(Part + (row * SPLITS + offs_s[:, None]) * HD + offs_d[None, :],
                   mask=s_ok[:, None] & (offs_d < HD)[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + row * HD + offs_d, o.to(Out.dtype.element_ty), mask=offs_d < HD)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_m(h: int, nkv: int, t: int) -> int:
    """Query rows per program: the G*T rows of one KV head, a power of two in [16, MAX_BLOCK_M]."""
    return max(16, min(triton.next_power_of_2((h // nkv) * t), MAX_BLOCK_M))


def splits_for(b: int, nkv: int, m_blocks: int, s: int, sms: int) -> int:
    """Key splits per (sequence, KV head, query block): enough programs to cover `sms` SMs, at most
    one per BLOCK_N slots of S and MAX_SPLITS. From shapes only (static per captured shape).
    Batch 1 decode of an 8-KV-head model at S = 768 on 132 SMs: 8 programs -> 12 splits."""
    programs = b * nkv * m_blocks
    if programs >= sms:
        return 1
    return max(1, min(-(-sms // programs), -(-s // BLOCK_N), MAX_SPLITS))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_table: torch.Tensor,
                    prefix: torch.Tensor, tree: torch.Tensor, scale: float, splits: int | None = None
                    ) -> torch.Tensor:
    """The module doc's function: q [B, T, H, hd] (last dim contiguous), k/v [nKV, rows, hd],
    row_table [B, S], prefix [B], tree [B, T, T] -> [B, T, H, hd] in q's dtype. `splits` overrides
    the key split count (tests); None picks `splits_for` the device."""
    b, t, h, hd = q.shape
    nkv = k.shape[0]
    s = row_table.shape[1]
    assert h % nkv == 0 and k.shape[2] == hd and v.shape == k.shape, (q.shape, k.shape, v.shape)
    assert row_table.shape[0] == b and prefix.shape == (b,) and tree.shape == (b, t, t), (
        row_table.shape, prefix.shape, tree.shape)
    if q.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError("AERIE_ATTENTION=paged on a non-CUDA device runs only in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before aerie starts (slow: for tests), or use another backend")
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    row_table, prefix, tree = row_table.contiguous(), prefix.contiguous(), tree.contiguous()
    g = h // nkv
    bm = block_m(h, nkv, t)
    m_blocks = -(-(g * t) // bm)
    n_splits = splits if splits is not None else splits_for(b, nkv, m_blocks, s, _sm_count(q.device))
    bd = triton.next_power_of_2(max(hd, 16))
    out = torch.empty(b, t, h, hd, dtype=q.dtype, device=q.device)
    if n_splits == 1:
        part, lse = out, out  # Lse unused
        strides = (out.stride(0), out.stride(1), out.stride(2), 0)
    else:
        part = torch.empty(b, t, h, n_splits, hd, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, t, h, n_splits, dtype=torch.float32, device=q.device)
        strides = (part.stride(0), part.stride(1), part.stride(2), part.stride(3))
    grid = (b * nkv, m_blocks, n_splits)
    _attend_kernel[grid](q, k, v, row_table, prefix, tree, part, lse, scale * math.log2(math.e),
                         q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         *strides, s, NKV=nkv, T=t, G=g, HD=hd, SPLITS=n_splits,
                         IEEE=q.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_D=bd,
                         num_warps=4, num_stages=2)  # 2 stages: fp32 q + K/V tiles stay under 228 KB of smem
    if n_splits > 1:
        _merge_kernel[(b * t * h,)](part, lse, out, SPLITS=n_splits, HD=hd,
                                    BLOCK_S=triton.next_power_of_2(n_splits), BLOCK_D=bd, num_warps=1)
    return out
