"""Small elementwise stages fused into one kernel each on CUDA (torch.compile -> Triton), eager elsewhere.

    rms_norm(x [.., H], weight [H], eps)   transformers' numerics: fp32 statistics, cast, times weight
    add_rms_norm(x, delta, weight, eps)    (x + delta, rms_norm(x + delta)): residual add and norm
    masked_softmax(scores, mask, scale, dtype)   attention's scale, mask, fp32 softmax and cast
    rotary(x [.., hd], cos, sin)           x * cos + rotate_half(x) * sin
    silu_mul(gate, up)                     silu(gate) * up

Eager, RMSNorm alone is 7 kernels and RoPE 5 per tensor: at batch 1 a decode step is made of such
launches (the GPU issue's 1,300+ kernels per forward). On CUDA each stage compiles once (on its
first call, before any CUDA graph is captured: the runner's warm-up calls it) into one kernel;
AERIE_FUSE=0 keeps them eager. The CPU always runs them eagerly (today's path, unchanged). Compiled
and eager agree to rounding, not bit for bit (the reduction order of the norm differs); the CUDA
path is the compiled one whether replayed from a graph or not, so graph == eager still holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
ENV = "AERIE_FUSE"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass."""
    y = x + delta
    return y, _rms_norm(y, weight, eps)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores * scale, masked where `mask` is False) in fp32, cast to `dtype` (attention's core)."""
    s = (scores.float() * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).to(dtype)


class _Fused:
    """fn eagerly, or compiled on CUDA inputs (compiled lazily; a failed compile falls back to
    eager for good and says so once)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.failed = False

    def __call__(self, x: torch.Tensor, *args):
        if x.device.type != "cuda" or self.failed or torch.is_grad_enabled() or not enabled():
            return self.fn(x, *args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        try:
            return self.compiled(x, *args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager stage is correct
            self.failed = True
            log.warning("fusing %s failed (%s: %s); it runs eagerly", self.fn.__name__, type(e).__name__, e)
            return self.fn(x, *args)


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no", "off")


rms_norm = _Fused(_rms_norm)
add_rms_norm = _Fused(_add_rms_norm)
masked_softmax = _Fused(_masked_softmax)
rotary = _Fused(_rotary)
silu_mul = _Fused(_silu_mul)
