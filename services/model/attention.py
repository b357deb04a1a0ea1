"""Attention kernels: which one runs for a forward, chosen by device and shape.

    attend(q [H, T, hd], k [nKV, S, hd], v [nKV, S, hd], mask [T, S] bool | None, causal) -> [H, T, hd]
    attend_gathered(q [B, H, T, hd], k [nKV, B, S, hd], v [nKV, B, S, hd], mask [B, T, S] bool)
        -> [B, H, T, hd]

Backends:
  sdpa     torch's scaled_dot_product_attention with `enable_gqa` (the CPU path, unchanged).
  grouped  two batched GEMMs over the query heads of each KV head ([nKV, G*T, hd] x [nKV, hd, S]),
           a boolean mask and an fp32 softmax: no KV expansion, any KV length, no plan to build.
           The CUDA path for short query blocks (decode, trees, small chunks).
  expanded the KV heads repeated to the query heads, then SDPA restricted to the flash and
           memory-efficient kernels (they refuse grouped heads with dense inputs). The CUDA path for
           long query blocks (prefill chunks), where the grouped scores [nKV, G*T, S] would be large.
  paged    a Triton kernel reading each sequence's keys in place from the paged arena through its
           row table (services/model/paged_attention.py): no gather copy, and a sequence's own
           length (a device value) bounds its key loop. Only the static-shape forward
           (`forward_uniform`, which has the row table) runs it; every other call (`attend`: the
           per-entry forward of long prefill chunks, the draft head) runs the backend it would run
           without the variable (`default_backend`). The CUDA default for static-shape blocks of
           up to PAGED_MAX_ROWS rows a sequence (decode steps and trees) when triton imports:
           measured on an H200 (Llama-3.1-8B shape, bf16, docs/gpu.md), plain decoding 5.81 vs 6.01
           ms/token with `grouped`, batched decode at N = 32 8.90 vs 13.21 ms a step; tree rounds
           0.25-0.9 ms faster in 9 of 9 comparisons of the second and fourth sessions (the first
           session's two split), and with it fp32 tokens through every tree shape equal the CPU's
           (its GPU test, fourth session). Needs `triton` (forced without it,
           `paged_attention_fn` says so; by default `grouped` runs) and, on the CPU, Triton's
           interpreter (TRITON_INTERPRET=1, tests only).

Why not SDPA's default on CUDA: from torch 2.11 it picks cuDNN on Hopper, whose execution plans are
cached by exact shape (KV length included), so a KV that grows by one row per token builds a new plan
every call (~2 ms of CPU each; the GPU issue's profile). Nothing here builds per-shape state, and
nothing reads a device value on the host (no synchronisation): positions, lengths and masks are
tensors.

`AERIE_ATTENTION=sdpa|grouped|expanded|paged` forces one backend for every call it can serve
(measurements, tests).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model import fused

log = logging.getLogger(__name__)

BACKENDS = ("sdpa", "grouped", "expanded", "paged")
ENV = "AERIE_ATTENTION"
GROUPED_MAX_ROWS = 64  # CUDA: query blocks up to this many rows use `grouped`, longer ones `expanded`
PAGED_MAX_ROWS = GROUPED_MAX_ROWS  # CUDA: static-shape blocks of up to this many rows a sequence use `paged`
PROBE_SLOTS = 1024  # key slots of the one step `paged_runs` tries


def backend_for(device: torch.device, rows: int) -> str:
    """The backend for a query block of `rows` rows on `device` (AERIE_ATTENTION overrides)."""
    forced = os.environ.get(ENV)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV} must be one of {', '.join(BACKENDS)}; got {forced!r}")
        return forced
    return default_backend(device, rows)


def default_backend(device: torch.device, rows: int) -> str:
    """The backend without AERIE_ATTENTION: SDPA on the CPU; on CUDA `grouped` up to
    GROUPED_MAX_ROWS query rows, else `expanded`."""
    if device.type != "cuda":
        return "sdpa"
    return "grouped" if rows <= GROUPED_MAX_ROWS else "expanded"


def paged_attention_fn(device: torch.device, rows: int, heads: DecodeHeads | None = None):
    """services.model.paged_attention.paged_attention when the static-shape forward of `rows` rows a
    sequence runs the `paged` backend, else None (the caller gathers and runs `attend_gathered`).
    Without AERIE_ATTENTION: on CUDA for up to PAGED_MAX_ROWS rows when triton imports and the
    kernel runs for `heads` and blocks of this width on this device (`paged_runs`: checked once for
    decode steps, once for trees; else None); forced
    (AERIE_ATTENTION=paged) it raises when triton is missing."""
    forced = bool(os.environ.get(ENV))
    if forced:
        if backend_for(device, rows) != "paged":
            return None
    elif device.type != "cuda" or rows > PAGED_MAX_ROWS:
        return None
    try:
        from services.model.paged_attention import paged_attention
    except ImportError as e:
        if forced:
            raise RuntimeError(f"{ENV}=paged needs the triton package (the paged attention kernel is a Triton "
                               f"kernel; on CUDA, torch's own triton): {e}") from e
        return None  # no triton: the gathered `grouped` path, as before the kernel
    if not forced and heads is not None and not _paged_runs_here(device, heads, paged_attention, rows):
        return None
    return paged_attention


@dataclass(frozen=True, slots=True)
class DecodeHeads:
    """What the paged kernel's build depends on for a model's decode steps."""
    dtype: torch.dtype
    heads: int  # query heads
    kv_heads: int
    head_dim: int


def paged_runs(kernel, device: torch.device, h: DecodeHeads, rows: int = 1) -> bool:
    """Whether `kernel` (paged_attention) builds and runs for one step of `rows` rows a sequence (1: a
    decode step; more: a tree, whose query block is wider) of `h` on `device`: a GPU whose Triton
    cannot build it (too little shared memory for the head size or the block, an unsupported
    architecture) keeps the gathered `grouped` path for those steps by default, with one warning,
    instead of failing every request."""
    try:  # 1024 key slots: on a GPU the key range is split across programs, so the merge kernel builds too
        q = torch.zeros(1, rows, h.heads, h.head_dim, dtype=h.dtype, device=device)
        kv = torch.zeros(h.kv_heads, PROBE_SLOTS, h.head_dim, dtype=h.dtype, device=device)
        index = torch.zeros(1, PROBE_SLOTS, dtype=torch.long, device=device)
        tree = torch.ones(1, rows, rows, dtype=torch.long, device=device)
        kernel(q, kv, kv, index, index[:, 0], tree, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 (serving goes on with `grouped`)
        steps = "decode steps" if rows == 1 else f"trees (steps of up to {rows} rows)"
        log.warning("the paged attention kernel does not run here (%s, %s): %s keep the gathered `grouped` "
                    "attention (%s=grouped silences this)", device, h, steps, ENV, exc_info=True)
        return False


# paged_runs' answers, per device, heads and kind of step (1: decode; PAGED_MAX_ROWS: every tree width)
_PAGED_RUNS: dict[tuple[torch.device, DecodeHeads, int], bool] = {}


def _paged_runs_here(device: torch.device, h: DecodeHeads, kernel, rows: int = 1) -> bool:
    """paged_runs, once per (device, heads) for decode steps and once for trees (tried at the widest
    tree, PAGED_MAX_ROWS rows: the kernel's query block, and so its resources, grow with the width).
    During a capture nothing can be tried: the answer so far, else yes (never the first call: a
    capture's warm-up runs first) and not remembered."""
    key = (device, h, 1 if rows == 1 else PAGED_MAX_ROWS)
    if key not in _PAGED_RUNS:
        if torch.cuda.is_current_stream_capturing():
            return True
        _PAGED_RUNS[key] = paged_runs(kernel, device, h, key[2])
    return _PAGED_RUNS[key]



def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool) -> torch.Tensor:
    """q [H, T, hd]; k, v [nKV, S, hd]; mask [T, S] bool (True = may attend) or None with `causal`
    (T == S: the causal triangle) or not (every row sees every key) -> [H, T, hd]."""
    h, t, hd = q.shape
    nkv, s = k.shape[0], k.shape[1]
    backend = backend_for(q.device, t)
    if backend == "paged":  # it needs the row table, which only the static-shape forward has
        backend = default_backend(q.device, t)
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=None if mask is None
                                             else mask[None, None], is_causal=causal and mask is None,
                                             enable_gqa=h != nkv)
        return out[0]
    if backend == "expanded":
        return _expanded(q, k, v, mask, causal)
    if mask is None:
        mask = (torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t) if causal
                else torch.ones(t, s, dtype=torch.bool, device=q.device))
    return attend_gathered(q[None], k[:, None], v[:, None], mask[None])[0]


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, hd]; k, v [nKV, B, S, hd] (as a paged gather leaves them: one index_select of the
    pool's rows); mask [B, T, S] bool -> [B, H, T, hd].

    Query head h reads KV head h // G (G = H / nKV, transformers' repeat_kv order), so the G query
    heads of one KV head form one [G*T, hd] block; the GEMMs batch over (KV head, sequence), so the
    keys are read where they lie and only the (small) queries are permuted. Masked softmax in fp32.
    Every row must see at least one key."""
    b, h, t, hd = q.shape
    nkv, s = k.shape[0], k.shape[2]
    g = h // nkv
    qg = q.reshape(b, nkv, g * t, hd).transpose(0, 1)  # [nKV, B, G*T, hd]
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(nkv, b, g, t, s)  # [nKV, B, G, T, S]
    probs = fused.masked_softmax(scores, mask[None, :, None], hd ** -0.5, v.dtype).view(nkv, b, g * t, s)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, h, t, hd)


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[0] // k.shape[0]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q[None], k[None], v[None],
                                             attn_mask=None if mask is None else mask[None, None],
                                             is_causal=causal and mask is None)
    return out[0]
