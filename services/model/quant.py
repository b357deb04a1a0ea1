"""Dynamic int8 linears (weights int8 per output channel, activations quantized per call by fbgemm
/ onednn), for the opt-in int8 target (`--dtype int8`) and the int8 draft (`--draft-dtype int8`).

    quantize_linears(module)   every `Linear` / `PackedLinear` under `module` -> `QuantLinear`
                               (packed ones keep `splits`, `names` and `split()`)

Numerics differ from fp32 (int8 weights and activations, int32 accumulation), so an int8 target is
lossless only against itself: speculative output == aerie's own int8 plain decoding. The draft's
numerics never affect losslessness. Uses torch's quantized CPU kernels; CPU only.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from services.model.linear import Linear, PackedLinear


class QuantLinear(nn.Module):
    """y [T, out] = dynamic_int8(x [T, in]) @ int8(W)^T + b (fp32 in and out)."""

    def __init__(self, source: Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        if isinstance(source, PackedLinear):
            self.splits, self.names = source.splits, source.names
        w = source.weight.detach().float().contiguous()
        bias = None if source.bias is None else source.bias.detach().float().contiguous()
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127.0).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks quantized tensor creation as deprecated
            qw = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, bias)
        # keep the dequantized weight's size for reporting only
        self.weight_bytes = w.numel()  # int8: one byte per weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic(x.float().reshape(-1, shape[-1]).contiguous(), self._packed)
        return y.reshape(*shape[:-1], self.out_features)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.splits, dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel dynamic"


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every Linear under `module` (and `module` itself if it is one) by a QuantLinear.
    Returns the (possibly new) module. Inference only."""
    if isinstance(module, Linear):
        return QuantLinear(module)
    for name, child in list(module.named_children()):
        setattr(module, name, quantize_linears(child))
    return module
