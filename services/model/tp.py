"""Tensor parallelism as a transform of the native target (the way gpt-fast's `apply_tp` works on
named linears): every rank of a group holds one shard of each layer and runs the same forward.

    plan = TPPlan.for_config(cfg, rank, world)    # checks the shapes: a clear error at start-up
    apply_tp(model, plan, comm)                    # meta or loaded TargetModel -> this rank's shard
    shard_tensor(key, tensor, plan)                # one checkpoint tensor -> this rank's slice

Per decoder layer (H hidden, h heads of size d, g KV heads, I intermediate, world W, rank r):
  qkv_proj      column-parallel: this rank's h/W query heads and the KV heads they read, sliced per
                part with PackedLinear's split sizes (q, k, v)
  o_proj        row-parallel: the matching d*h/W input columns; partial sums all-reduced, bias after
  gate_up_proj  column-parallel: I/W rows of gate and of up
  down_proj     row-parallel: the matching I/W input columns; all-reduced, bias after
  KV heads      g/W per rank; when W > g (and W % g == 0) each KV head is replicated on W/g ranks
The embedding and the lm_head are vocabulary-parallel (ceil(V/W) rows per rank, the last shard
shorter when V % W != 0): a token outside this rank's rows embeds to zero and the all-reduce
completes the row; the lm_head's partial logits are gathered as full rows on rank 0 only (other
ranks get [T, 0]: the rank-0 verifier alone accepts and samples). Norms and RoPE are replicated,
so `hidden` and `taps` (the residual stream) are full and identical on every rank.

Any other shape that does not divide (heads, intermediate size) is a `TPShapeError` naming the
numbers. int8 linears are not supported with TP. The communication is `Comm` (services/dist): a
deadline on every collective lives there; this module is pure model code and imports no gRPC.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.errors import AerieError
from services.model.config import ModelConfig
from services.model.linear import Linear, PackedLinear

if TYPE_CHECKING:
    from services.model.target import DecoderLayer, TargetModel


class TPShapeError(AerieError, ValueError):
    """The model's shapes cannot be split over this group size."""


class Comm(Protocol):
    """The collectives a sharded forward needs (services/dist/group.py implements them)."""
    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor) -> None: ...  # in place, sum
    def gather_rows(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None: ...  # [T, v_r] -> [T, V] on rank 0


@dataclass(frozen=True, slots=True)
class TPPlan:
    rank: int
    world: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_first: int  # index of this rank's first KV head in the full model
    head_dim: int
    intermediate: int  # intermediate rows per projection on this rank
    vocab_sizes: tuple[int, ...]  # lm_head / embedding rows on each rank

    @property
    def vocab_start(self) -> int:
        return sum(self.vocab_sizes[: self.rank])

    @property
    def vocab_rows(self) -> int:
        return self.vocab_sizes[self.rank]

    @staticmethod
    def for_config(cfg: ModelConfig, rank: int, world: int) -> TPPlan:
        if world < 1 or not 0 <= rank < world:
            raise TPShapeError(f"tensor-parallel rank {rank} of a group of {world} is not valid")
        h, g = cfg.num_heads, cfg.num_kv_heads
        if h % world:
            raise TPShapeError(f"tensor parallelism {world} does not divide the model's {h} attention heads "
                               f"(choose a group size that divides {h})")
        if cfg.intermediate_size % world:
            raise TPShapeError(f"tensor parallelism {world} does not divide the MLP's intermediate size "
                               f"{cfg.intermediate_size}")
        if g % world == 0:
            kv, kv_first = g // world, rank * (g // world)
        elif world % g == 0:  # more ranks than KV heads: each KV head on world/g ranks
            kv, kv_first = 1, rank * g // world
        else:
            raise TPShapeError(f"tensor parallelism {world} neither divides the model's {g} KV heads nor is "
                               f"a multiple of them (choose a group size that divides {g} or a multiple of {g})")
        step = -(-cfg.vocab_size // world)
        vocab = tuple(max(0, min(step, cfg.vocab_size - i * step)) for i in range(world))
        if min(vocab) == 0:
            raise TPShapeError(f"a vocabulary of {cfg.vocab_size} tokens is too small for {world} ranks")
        return TPPlan(rank, world, h // world, kv, kv_first, cfg.head_dim, cfg.intermediate_size // world, vocab)


# ---- modules -------------------------------------------------------------------------------------


class RowParallelLinear(Linear):
    """This rank's input columns of a Linear; the partial products are all-reduced, then the
    (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm) -> None:
        super().__init__(in_features, out_features, bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.shape[0] <= self.max_rows_t:
            y = x @ self.weight_t
        else:
            y = F.linear(x, self.weight)
        self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the embedding; other tokens embed to zero before the all-reduce."""

    def __init__(self, rows: int, dim: int, start: int, comm: Comm) -> None:
        super().__init__(rows, dim)
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        x = x * inside[:, None].to(x.dtype)
        self.comm.all_reduce(x)
        return x


class VocabParallelHead(Linear):
    """This rank's vocabulary rows of the lm_head; full logit rows are gathered on rank 0 ([T, V]),
    the other ranks return [T, 0]."""

    def __init__(self, in_features: int, plan: TPPlan, comm: Comm) -> None:
        super().__init__(in_features, plan.vocab_rows, bias=False)
        self.sizes = list(plan.vocab_sizes)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = super().forward(x)
        full = self.comm.gather_rows(part.float(), self.sizes)
        return full if full is not None else part[:, :0]


# ---- the transform -------------------------------------------------------------------------------


def apply_tp(model: TargetModel, plan: TPPlan, comm: Comm) -> TargetModel:
    """Replace `model`'s (a TargetModel, on meta or loaded in full) modules by this rank's shards.
    A loaded model's weights are sliced (`shard_tensor`); a meta model keeps meta shards for
    `load_state_dict(assign=True)` to fill. Returns the model."""
    cfg: ModelConfig = model.config
    if any(type(m).__name__ == "QuantLinear" for m in model.modules()):
        raise TPShapeError("int8 linears are not supported with tensor parallelism: use fp32 or bf16")
    full = {k: v for k, v in model.state_dict().items()}
    first = model.model.embed_tokens.weight
    meta = first.is_meta  # new modules are built on meta; a loaded model's slices are assigned

    for layer in cast("list[DecoderLayer]", model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads
        q, kv = plan.num_heads * plan.head_dim, plan.num_kv_heads * plan.head_dim
        with torch.device("meta"):
            qkv = PackedLinear(cfg.hidden_size, (q, kv, kv), ("q_proj", "k_proj", "v_proj"), bias=cfg.qkv_bias)
            o = RowParallelLinear(q, cfg.hidden_size, cfg.o_bias, comm)
            gate_up = PackedLinear(cfg.hidden_size, (plan.intermediate,) * 2, ("gate_proj", "up_proj"),
                                   bias=cfg.mlp_bias)
            down = RowParallelLinear(plan.intermediate, cfg.hidden_size, cfg.mlp_bias, comm)
        attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj = qkv, o, gate_up, down
    with torch.device("meta"):
        model.model.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, cfg.hidden_size, plan.vocab_start, comm)
        model.lm_head = VocabParallelHead(cfg.hidden_size, plan, comm)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = cast(nn.Parameter, model.model.embed_tokens.weight)
    if not meta:
        state = {k: shard_tensor(k, v, plan).clone() for k, v in full.items()}
        model.load_state_dict(state, strict=True, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = cast(nn.Parameter, model.model.embed_tokens.weight)
    object.__setattr__(model, "tp_plan", plan)  # a plain attribute (nn.Module's setattr is typed for tensors)
    return model


_PART = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")


def shard_tensor(key: str, tensor, plan: TPPlan) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `key` (Hugging Face names; the packed `qkv_proj` /
    `gate_up_proj` names are sliced part by part). `tensor` is a torch tensor or anything indexable
    the same way (a safetensors slice: only the slice is read from disk)."""
    if key.endswith("embed_tokens.weight") or key == "lm_head.weight":
        start = plan.vocab_start
        return tensor[start:start + plan.vocab_rows]
    m = _PART.search(key)
    if m is None:
        for packed, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{packed}." in key:  # a packed state-dict name (an in-memory model's state_dict)
                raise AssertionError(f"shard {key} by its parts {parts}")
        return tensor[:]  # norms: replicated
    part, kind = m.groups()
    d = plan.head_dim
    if part == "q_proj":
        return tensor[plan.rank * plan.num_heads * d:(plan.rank + 1) * plan.num_heads * d]
    if part in ("k_proj", "v_proj"):
        return tensor[plan.kv_first * d:(plan.kv_first + plan.num_kv_heads) * d]
    if part == "o_proj":
        cols = slice(plan.rank * plan.num_heads * d, (plan.rank + 1) * plan.num_heads * d)
        return tensor[:, cols] if kind == "weight" else tensor[:]
    if part in ("gate_proj", "up_proj"):
        return tensor[plan.rank * plan.intermediate:(plan.rank + 1) * plan.intermediate]
    cols = slice(plan.rank * plan.intermediate, (plan.rank + 1) * plan.intermediate)  # down_proj
    return tensor[:, cols] if kind == "weight" else tensor[:]
