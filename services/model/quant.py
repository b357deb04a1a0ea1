"""Dynamic int8 linears (weights int8 per output channel, activations quantized per row at each call,
int8 x int8 -> int32 products by `torch._int_mm`), for the opt-in int8 target (`--dtype int8`) and the
int8 draft (`--draft-dtype int8`).

    quantize_linears(module)   every `Linear` / `PackedLinear` under `module` -> `QuantLinear`
                               (packed ones keep `splits`, `names` and `split()`)

Numerics differ from fp32 (int8 weights and activations, int32 accumulation), so an int8 target is
lossless only against itself: speculative output == aerie's own int8 plain decoding. The draft's
numerics never affect losslessness. Uses torch's quantized CPU kernels; CPU only.
"""

from __future__ import annotations

import torch
from torch import nn

from services.model.linear import Linear, PackedLinear


class QuantLinear(nn.Module):
    """y [T, out] = int8(x) [T, in] @ int8(W)^T [in, out] (int32, exact) * per-row x scale * per-channel
    W scale + b. Activations are quantized PER ROW, so a row's result never depends on the other rows
    of the call: a T-row verification gives each row exactly what a 1-row decode gives (an int8 target
    is then lossless against its own plain decoding). Per-tensor dynamic quantization (torch's
    `quantize_dynamic`) breaks that: its activation scale is taken over the whole batch."""

    w_scale: torch.Tensor  # [out] (buffers, registered in __init__)
    wq_t: torch.Tensor  # [in, out] int8
    bias: torch.Tensor | None  # [out]

    def __init__(self, source: Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        if isinstance(source, PackedLinear):
            self.splits, self.names = source.splits, source.names
        w = source.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("w_scale", scale)
        self.register_buffer("wq_t", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).t().contiguous())
        bias = None if source.bias is None else source.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.float().reshape(-1, shape[-1])
        sx = x2.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0  # [T, 1]
        xq = torch.round(x2 / sx).clamp(-127, 127).to(torch.int8)
        y = torch._int_mm(xq, self.wq_t).float() * sx * self.w_scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, list(self.splits), dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 weights per channel, activations per row"


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every Linear under `module` (and `module` itself if it is one) by a QuantLinear.
    Returns the (possibly new) module. Inference only."""
    if isinstance(module, Linear):
        return QuantLinear(module)
    for name, child in list(module.named_children()):
        setattr(module, name, quantize_linears(child))
    return module
