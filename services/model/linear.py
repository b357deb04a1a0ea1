"""Linear layers in the layout the CPU GEMM prefers, and packed projections that keep their names.

    Linear(in, out, bias)                       y [T, out] = x [T, in] @ W^T + b
    PackedLinear(in, (q, k, v), ("q_proj", "k_proj", "v_proj"), bias)
                                                one GEMM for several projections of the same input;
                                                y [T, q+k+v], split with `split(y)`

`weight` is always the Hugging Face layout [out, in], so checkpoints load by name and a
tensor-parallel transform can slice it (rows = column-parallel outputs; `PackedLinear.parts()` gives
each projection's row range so it can be sliced per projection). `freeze("transposed")` (inference
only) replaces the storage by one contiguous [in, out] copy, `weight_t`, that `x @ weight_t` reads:
MKL's `F.linear` path is slow at one row for wide outputs on this CPU (docs/design.md "Cheaper rounds");
`weight` is then a view of `weight_t`. `freeze("onednn")` keeps that one [in, out] copy for a single
row and a oneDNN-prepacked copy for 2+ rows (`torch.ops.mkldnn._linear_pointwise`, the kernel
torch.compile's CPU backend uses): MKL's sgemm costs ~2x per added row at 2-16 rows here, the packed
kernel about the same at 1-16 rows (docs/design.md "Cheaper rounds"); it falls back to "both" off the CPU or
without oneDNN.

A module owning a PackedLinear calls `keep_part_names(self, attr)`: its state_dict shows the parts
under their own names (`q_proj.weight`, ...) and loading accepts them, concatenating at load time.
So target and head checkpoints, the trainer and `save_head` see exactly the Hugging Face keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_ROW_STEP = 4  # the packed kernel sees row counts padded (zero rows) to a multiple of this
ONEDNN_MAX_ROWS = 64  # more rows (prefill chunks) go to F.linear: at most 16 oneDNN shapes per weight


class Linear(nn.Module):
    """nn.Linear's parameters and numerics (fp32 accumulation by the same BLAS), with an optional
    pre-transposed storage for inference."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None  # [in, out] contiguous once frozen transposed
        self.max_rows_t = 1 << 30  # rows up to this use weight_t; more use F.linear (layout "both")
        self.weight_packed: torch.Tensor | None = None  # oneDNN-packed copy for more rows (layout "onednn")
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's init (training from scratch)
        if self.bias is not None:
            bound = 1 / in_features ** 0.5 if in_features else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.shape[0] <= self.max_rows_t:
            y = x @ self.weight_t
            return y if self.bias is None else y + self.bias
        packed = self.weight_packed
        rows = x.shape[0]
        if (packed is not None and rows <= ONEDNN_MAX_ROWS and x.dim() == 2 and x.device.type == "cpu"
                and x.dtype == packed.dtype):
            # rows rounded up to a multiple of ONEDNN_ROW_STEP (2-3 rows: its 4-row kernel is faster):
            # oneDNN keeps a primitive (and memory) per distinct shape, so the shapes must be few
            padded = -(-rows // ONEDNN_ROW_STEP) * ONEDNN_ROW_STEP
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, self.bias, "none", [], "")
            return y[:rows]
        return F.linear(x, self.weight, self.bias)

    def freeze(self, layout: str, max_rows_t: int = 1) -> None:
        """Inference layout (not for training):
        "hf"          keep [out, in]; F.linear for every row count
        "transposed"  ONE copy, [in, out] contiguous, `x @ weight_t` for every row count; `weight`
                      becomes a view of it (state_dict and slicing still see [out, in])
        "both"        two copies: `x @ weight_t` up to `max_rows_t` rows, F.linear above
        "onednn"      two copies: `x @ weight_t` up to `max_rows_t` rows, the oneDNN-packed copy
                      above; `weight` becomes a view of `weight_t` (CPU fp32/bf16 only, else "both")"""
        if layout == "hf" or self.weight_t is not None or self.weight.is_meta:
            return
        assert layout in ("transposed", "both", "onednn"), layout
        packed = None
        if layout == "onednn":
            packed = onednn_pack(self.weight.detach())
            if packed is None:
                layout = "both"
        wt = self.weight.detach().t().contiguous()
        self.weight_t = wt
        if layout in ("transposed", "onednn"):
            self.weight = nn.Parameter(wt.t(), requires_grad=False)
        if layout in ("both", "onednn"):
            self.max_rows_t = max_rows_t
        self.weight_packed = packed

    def extra_repr(self) -> str:
        layout = "[in, out]" if self.weight_t is not None else "[out, in]"
        layout += " + oneDNN-packed" if self.weight_packed is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, layout={layout}"


class PackedLinear(Linear):
    """Several projections of one input fused into one GEMM. `splits` are the output sizes and
    `names` the Hugging Face names of the parts, in order (e.g. q, k, v)."""

    def __init__(self, in_features: int, splits: tuple[int, ...], names: tuple[str, ...],
                 bias: bool = False) -> None:
        assert len(splits) == len(names) and splits, (splits, names)
        super().__init__(in_features, sum(splits), bias)
        self.splits = tuple(int(s) for s in splits)
        self.names = tuple(names)

    def parts(self) -> dict[str, tuple[int, int]]:
        """name -> (first output row, row count) inside `weight` [sum(splits), in]."""
        out, start = {}, 0
        for name, size in zip(self.names, self.splits, strict=True):
            out[name] = (start, size)
            start += size
        return out

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, sum(splits)] -> one [T, split] view per part."""
        return torch.split(y, list(self.splits), dim=-1)

    def part_weight(self, name: str) -> torch.Tensor:
        start, size = self.parts()[name]
        return self.weight[start:start + size]

    def part_bias(self, name: str) -> torch.Tensor | None:
        if self.bias is None:
            return None
        start, size = self.parts()[name]
        return self.bias[start:start + size]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", parts={dict(zip(self.names, self.splits, strict=True))}"


def keep_part_names(owner: nn.Module, attr: str) -> None:
    """Make `owner`'s state_dict list `getattr(owner, attr)`'s parts under their own names
    (`<prefix>q_proj.weight`, ...) instead of `<prefix><attr>.weight`, and accept them on load."""
    suffixes = ("weight", "bias")

    def to_parts(module, state, prefix, local_metadata) -> None:
        packed: PackedLinear = getattr(module, attr)
        for suffix in suffixes:
            key = f"{prefix}{attr}.{suffix}"
            if key not in state:
                continue
            whole = state.pop(key)
            for name, (start, size) in packed.parts().items():
                # a copy: safetensors refuses tensors that share storage
                state[f"{prefix}{name}.{suffix}"] = whole[start:start + size].clone()

    def from_parts(module, state, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        packed: PackedLinear = getattr(module, attr)
        for suffix in suffixes:
            keys = [f"{prefix}{name}.{suffix}" for name in packed.names]
            present = [k for k in keys if k in state]
            if not present:
                continue
            if len(present) != len(keys):
                continue  # leave them: strict loading reports the missing and unexpected names
            parts = [state.pop(k) for k in keys]
            state[f"{prefix}{attr}.{suffix}"] = torch.cat(parts, dim=0)

    owner.register_state_dict_post_hook(to_parts)
    owner.register_load_state_dict_pre_hook(from_parts)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] prepacked for oneDNN's linear, or None where that kernel is unavailable
    (not a CPU tensor, not fp32/bf16, a torch build without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (RuntimeError, AttributeError):
        return None


def parse_layout(layout: str) -> tuple[str, int]:
    """"hf" | "transposed" | "both[:N]" | "onednn[:N]" -> (layout, max_rows_t); N (rows read from
    the [in, out] copy) defaults to 2 for "both" and 1 for "onednn"."""
    name, _, rows = layout.partition(":")
    if name not in ("hf", "transposed", "both", "onednn") or (
            rows and (name not in ("both", "onednn") or not rows.isdigit())):
        raise ValueError(f"weight layout must be hf, transposed, both[:N] or onednn[:N]; got {layout!r}")
    return name, int(rows or (1 if name == "onednn" else 2))


def freeze_linears(module: nn.Module, layout: str) -> None:
    """`freeze` every Linear under `module` (inference layout, see `parse_layout`)."""
    name, rows = parse_layout(layout)
    for m in module.modules():
        if isinstance(m, Linear):
            m.freeze(name, rows)
