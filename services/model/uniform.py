"""The static-shape forward: B sequences x T rows each over a paged KV, capturable in a CUDA graph.

    runner = UniformRunner(target, pool, graphs=True)   # pool: a PagedKVPool
    shape = runner.shape_for(step)                      # a UniformShape, or None (an eager step)
    out = runner.execute(step, shape)                   # StepOutput, as TargetModel.forward_step

A Step whose entries each have at most `max_width` rows (plain decodes, verification trees, short
chunks) is padded to a captured shape (B, T, S): B sequences (batch buckets 1, 2, 4, 8, 16, 32, ...),
T rows each (width buckets 1, 2, 4, ... 64) and S key slots each (`key_bucket`: a multiple of 256 covering the
longest prefix + T). Every entry becomes a tree of T rows: its own tree mask (or the causal triangle)
top-left, padded rows seeing only themselves; padded rows and padded sequences write their K/V to
the pool's trash page and nothing real reads them. All inputs travel in one int64 buffer filled by
one host-to-device copy per step:

    ids [B*T], positions [B*T], write_rows [B*T] (arena row of each new row's K/V),
    row_table [B*S] (arena row of each key slot), prefix [B] (committed rows), tree [B*T*T] (0/1)

so `forward_uniform` reads no device value on the host (a graph replays it as captured) and its
Python control flow depends only on (B, T, S). With `graphs=True` (CUDA) each shape is captured
once, on first use, into a graph sharing one memory pool; replays give the eager forward's bits.
A replay's logits are views of the graph's own buffers, valid until the next `execute` (the
verifier reads them at once); its hidden states and taps are copies (features outlive the step).

Attention, per layer: the S key slots of every sequence are gathered from the arena into
[nKV, B, S, hd] and `attend_gathered` runs over them with the mask `key_mask` builds (the default);
with AERIE_ATTENTION=paged a Triton kernel (services/model/paged_attention.py) reads them in place
through the row table instead, looping over each sequence's own prefix + T slots only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.model import fused
from services.model.attention import DecodeHeads, attend_gathered, paged_attention_fn
from services.model.paged_kv import TRASH_ROW, PagedKVPool
from services.model.step import Step, StepOutput
from services.model.transfer import staged

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEYS = 256


@dataclass(frozen=True, slots=True)
class UniformShape:
    batch: int  # B: sequences (padded)
    width: int  # T: rows per sequence (padded)
    keys: int  # S: key slots per sequence
    taps: bool  # also return the EAGLE-3 taps

    def sizes(self) -> tuple[int, ...]:
        """Lengths of the input buffer's parts: ids, positions, write_rows, row_table, prefix, tree."""
        b, t, s = self.batch, self.width, self.keys
        return (b * t, b * t, b * t, b * s, b, b * t * t)


@dataclass(frozen=True, slots=True)
class UniformOutput:
    logits: torch.Tensor  # [B*T, V] fp32
    hidden: torch.Tensor  # [B*T, H]
    taps: torch.Tensor | None  # [B*T, 3H]


def capture_graph(fn: Callable[[], Any], device: torch.device, mempool) -> tuple[Any, Any]:
    """(graph, output): `fn` warmed up twice on a side stream (kernel selection, compiled stages),
    then captured into a CUDA graph in `mempool`; its output tensors are the graph's static outputs."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        output = fn()
    torch.cuda.synchronize(device)
    return graph, output


def graph_pool_bytes(mempool) -> int:
    """CUDA memory the caching allocator holds in the graphs' private pool `mempool` (0 without one).
    Not memory_reserved: each capture empties the allocator's cache first (torch.cuda.graph), so the
    device-wide figure can shrink while graphs are captured."""
    if mempool is None:
        return 0
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(mempool))


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def key_bucket(need: int) -> int:
    """Key slots for `need` rows: a multiple of MIN_KEYS up to 16 of them, then a power of two (the
    gather and the scores are paid per slot: 532 rows take 768 slots, not 1024)."""
    if need <= 16 * MIN_KEYS:
        return MIN_KEYS * max(1, -(-need // MIN_KEYS))
    return 1 << (need - 1).bit_length()


@torch.no_grad()
def forward_uniform(target, pool: PagedKVPool, shape: UniformShape, inputs: torch.Tensor) -> UniformOutput:
    """One target forward over B x T rows (see the module doc); `inputs` is the int64 buffer.
    Writes every row's K/V into the pool (padding into the trash page); lengths are the caller's."""
    b, t, s = shape.batch, shape.width, shape.keys
    ids, positions, write_rows, row_table, prefix, tree = inputs.split(shape.sizes())
    x = target.model.embed_tokens(ids)  # [B*T, H]
    cos_t, sin_t = target.rotary.tables(0, x.dtype, x.device)  # precomputed (UniformRunner)
    cos, sin = cos_t[positions], sin_t[positions]
    attn0 = target.model.layers[0].self_attn
    heads = DecodeHeads(x.dtype, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim)
    paged = paged_attention_fn(x.device, t, heads)  # the paged kernel: keys read in place, no gather
    if paged is None:
        mask = key_mask(prefix, tree.view(b, t, t).bool(), s)  # [B, T, S]
    taps: list[torch.Tensor] = []
    tap_layers = target.config.eagle3_tap_layers if shape.taps else ()
    layers = target.model.layers
    h = layers[0].input_layernorm(x)
    for i, layer in enumerate(layers):
        if i in tap_layers:
            taps.append(x)
        attn = layer.self_attn
        q, k, v = attn.rotated(attn.qkv_proj(h), cos, sin)  # [B*T, h|g, hd]
        ka, va = pool.k[i], pool.v[i]  # [g, rows, hd]
        ka.index_copy_(1, write_rows, k.transpose(0, 1))
        va.index_copy_(1, write_rows, v.transpose(0, 1))
        g, hd = attn.num_kv_heads, attn.head_dim
        if paged is not None:
            out = paged(q.view(b, t, attn.num_heads, hd), ka, va, row_table.view(b, s), prefix,
                        tree.view(b, t, t), hd ** -0.5)  # [B, T, h, hd]
        else:
            keys = ka.index_select(1, row_table).view(g, b, s, hd)  # [g, B, S, hd], contiguous
            vals = va.index_select(1, row_table).view(g, b, s, hd)
            out = attend_gathered(q.view(b, t, attn.num_heads, hd).transpose(1, 2), keys, vals,
                                  mask).transpose(1, 2)  # [B, T, h, hd]
        post = layer.post_attention_layernorm
        x, h = fused.add_rms_norm(x, attn.o_proj(out.reshape(b * t, attn.num_heads * hd)), post.weight, post.eps)
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else target.model.norm
        x, h = fused.add_rms_norm(x, layer.mlp(h), norm.weight, norm.eps)
    hidden = h  # the final norm of the last residual
    logits = target.lm_head(hidden).float()
    return UniformOutput(logits, hidden, torch.cat(taps, dim=-1) if shape.taps else None)


def key_mask(prefix: torch.Tensor, tree: torch.Tensor, keys: int) -> torch.Tensor:
    """prefix [B], tree [B, T, W] bool -> [B, T, S] bool: key slot r is visible to row t when it is
    committed (r < prefix) or one of the W new rows after the prefix that row t may see
    (tree[t, r - prefix])."""
    b, t, w = tree.shape
    rel = torch.arange(keys, device=tree.device)[None, :] - prefix[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < w)
    seen = tree.gather(2, rel.clamp(0, w - 1)[:, None, :].expand(b, t, keys))  # [B, T, S]
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & seen)


class UniformRunner:
    """Plans, fills and runs uniform steps for one target over one paged pool (eagerly, or from
    CUDA graphs captured per shape)."""

    def __init__(self, target, pool: PagedKVPool, graphs: bool = False, max_width: int = WIDTH_BUCKETS[-1],
                 max_batch: int = BATCH_BUCKETS[-1]) -> None:
        self.target, self.pool = target, pool
        self.graphs_on = graphs
        self.max_width, self.max_batch = max_width, max_batch
        self.max_keys = 1 << max(MIN_KEYS.bit_length() - 1, (target.config.max_context - 1).bit_length())
        # RoPE tables for every position, computed once: a graph holds their address
        target.rotary.tables(self.max_keys, target.dtype, target.device)
        self._graphs: dict[UniformShape, _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if graphs else None
        self.capture_s = 0.0  # total capture time so far
        self.captures = 0
        self._warm: set[UniformShape] = set()  # shapes run eagerly by warm_up (graphs off)

    def shape_for(self, step: Step) -> UniformShape | None:
        """The padded shape of `step`, or None when an entry is wider than `max_width` or the batch
        larger than `max_batch` (such steps run eagerly, entry by entry)."""
        caches = [self.pool.cache(e.slot) for e in step.entries]
        width = bucket(max(e.rows for e in step.entries), WIDTH_BUCKETS)
        batch = bucket(len(step.entries), BATCH_BUCKETS)
        if width is None or width > self.max_width or batch is None or batch > self.max_batch:
            return None
        need = max(c.length + width for c in caches)
        keys = key_bucket(need)
        if keys > self.max_keys:
            return None
        return UniformShape(batch, width, keys, step.want_taps)

    def fill(self, step: Step, shape: UniformShape) -> torch.Tensor:
        """The int64 input buffer of `step` padded to `shape` (host, numpy-built). Input ids, positions
        and tree masks already on the model's device are left 0 / the identity here (`execute` copies
        them on the device: no host read)."""
        b, t, s = shape.batch, shape.width, shape.keys
        ids = np.zeros((b, t), np.int64)
        pos = np.zeros((b, t), np.int64)
        write = np.full((b, t), TRASH_ROW, np.int64)
        table = np.full((b, s), TRASH_ROW, np.int64)
        prefix = np.zeros(b, np.int64)
        tree = np.broadcast_to(np.eye(t, dtype=np.int64), (b, t, t)).copy()
        for j, e in enumerate(step.entries):
            cache = self.pool.paged(e.slot)
            rows = cache.rows_host
            n, p = e.rows, cache.length
            here = self.target.device
            if e.input_ids.device != here:
                ids[j, :n] = e.input_ids.cpu().numpy()
            if e.positions is None:
                pos[j, :n] = np.arange(p, p + n)
            elif e.positions.device != here:
                pos[j, :n] = e.positions.cpu().numpy()
            write[j, :n] = rows[p:p + n]
            m = min(s, rows.shape[0])
            table[j, :m] = rows[:m]
            prefix[j] = p
            if e.tree_mask is None:
                tree[j, :n, :n] = np.tril(np.ones((n, n), np.int64))
            elif e.tree_mask.device != here:
                tree[j, :n, :n] = e.tree_mask.cpu().numpy()
        return torch.from_numpy(np.concatenate([a.reshape(-1) for a in (ids, pos, write, table, prefix, tree)]))

    def execute(self, step: Step, shape: UniformShape) -> StepOutput:
        """One forward over every entry of `step` padded to `shape`; advances the entries' lengths.
        Raises (writing nothing) when an entry's slot cannot take its rows."""
        caches = [self.pool.cache(e.slot) for e in step.entries]
        for e, cache in zip(step.entries, caches, strict=True):
            cache.reserve(e.rows)
        host = self.fill(step, shape)
        graph = (self._graphs.get(shape) or self._capture(shape)) if self.graphs_on else None
        dev = self.target.device
        inputs = graph.inputs.copy_(staged(host, dev), non_blocking=True) if graph is not None else host.to(dev)
        self._copy_on_device(step, shape, inputs)
        if graph is not None:
            graph.graph.replay()
            out = graph.output
        else:
            out = forward_uniform(self.target, self.pool, shape, inputs)
        for e, cache in zip(step.entries, caches, strict=True):
            cache.advance(e.rows)
        return self._unpad(step, shape, out)

    def _copy_on_device(self, step: Step, shape: UniformShape, inputs: torch.Tensor) -> None:
        """Copy what `fill` left out (inputs already on the device: a plain run's previous argmax, a
        TreeOnDevice's tokens, positions and mask) into the device input buffer, on the device."""
        b, t, here = shape.batch, shape.width, self.target.device
        tree_at = sum(shape.sizes()[:5])  # after ids, positions, write_rows, row_table, prefix
        for j, e in enumerate(step.entries):
            n = e.rows
            if e.input_ids.device == here:
                inputs[j * t:j * t + n].copy_(e.input_ids)
            if e.positions is not None and e.positions.device == here:
                inputs[b * t + j * t:b * t + j * t + n].copy_(e.positions)
            if e.tree_mask is not None and e.tree_mask.device == here:
                inputs[tree_at + j * t * t:tree_at + (j + 1) * t * t].view(t, t)[:n, :n].copy_(e.tree_mask)

    def _unpad(self, step: Step, shape: UniformShape, out: UniformOutput) -> StepOutput:
        t = shape.width
        offsets = [0]
        for e in step.entries:
            offsets.append(offsets[-1] + e.rows)
        logits = tuple(out.logits[j * t:j * t + e.rows] if e.logits == "all"
                       else out.logits[j * t + e.rows - 1:j * t + e.rows] for j, e in enumerate(step.entries))
        if all(e.rows == t for e in step.entries) or len(step.entries) == 1:  # copies: callers keep
            hidden = out.hidden[:offsets[-1]].clone()  # features past the next step
            taps = out.taps[:offsets[-1]].clone() if out.taps is not None else None
        else:
            rows = [np.arange(j * t, j * t + e.rows) for j, e in enumerate(step.entries)]
            idx = torch.from_numpy(np.concatenate(rows)).to(out.hidden.device)
            hidden = out.hidden.index_select(0, idx)
            taps = out.taps.index_select(0, idx) if out.taps is not None else None
        return StepOutput(logits=logits, hidden=hidden, taps=taps if step.want_taps else None, offsets=tuple(offsets))

    def warm_up(self, batches: tuple[int, ...], widths: tuple[int, ...], taps: tuple[bool, ...] = (False,),
                keys: int = MIN_KEYS) -> WarmUp:
        """Prepare the shapes (B, T, `keys`, taps) for every B in `batches` and T in `widths` (bucketed,
        capped at max_batch / max_width) before any request: with graphs, capture each one not yet
        captured; without, run each once eagerly (first-call work: the fused stages' compilation on
        CUDA). Padding rows only: every write goes to the trash page. -> what it took (the caller
        logs it at start-up)."""
        device = self.target.device
        t0 = time.perf_counter()
        held = graph_pool_bytes(self._mempool)
        shapes = sorted({UniformShape(bb, ww, keys, tp)
                         for b in batches if (bb := bucket(b, BATCH_BUCKETS)) is not None and bb <= self.max_batch
                         for w in widths if (ww := bucket(w, WIDTH_BUCKETS)) is not None and ww <= self.max_width
                         for tp in taps}, key=lambda sh: (sh.batch, sh.width, sh.keys, sh.taps))
        done = 0
        for shape in shapes:
            if shape in self._graphs or shape in self._warm:
                continue
            if self.graphs_on:
                self._capture(shape)
            else:
                forward_uniform(self.target, self.pool, shape, self._idle(shape).to(device))
                self._warm.add(shape)
            done += 1
        return WarmUp(done, time.perf_counter() - t0, graph_pool_bytes(self._mempool) - held, self.graphs_on)

    def _capture(self, shape: UniformShape) -> _Graph:
        t0 = time.perf_counter()
        device = self.target.device
        inputs = torch.zeros(sum(shape.sizes()), dtype=torch.long, device=device)
        # a valid warm-up input: every row sees itself only, all writes go to the trash page
        inputs.copy_(self._idle(shape))
        graph, output = capture_graph(lambda: forward_uniform(self.target, self.pool, shape, inputs), device,
                                      self._mempool)
        g = _Graph(graph, inputs, output)
        self._graphs[shape] = g
        dt = time.perf_counter() - t0
        self.capture_s += dt
        self.captures += 1
        log.info("captured a CUDA graph for %d sequence(s) x %d row(s) x %d keys%s in %.2f s "
                 "(%d graphs, %.1f s in all)", shape.batch, shape.width, shape.keys,
                 " with taps" if shape.taps else "", dt, self.captures, self.capture_s)
        return g

    def _idle(self, shape: UniformShape) -> torch.Tensor:
        b, t, s = shape.batch, shape.width, shape.keys
        parts = [np.zeros(b * t, np.int64), np.zeros(b * t, np.int64), np.full(b * t, TRASH_ROW, np.int64),
                 np.full(b * s, TRASH_ROW, np.int64), np.zeros(b, np.int64),
                 np.broadcast_to(np.eye(t, dtype=np.int64), (b, t, t)).reshape(-1)]
        return torch.from_numpy(np.concatenate(parts))


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What `UniformRunner.warm_up` did."""
    shapes: int  # shapes captured (graphs) or run once (eagerly)
    seconds: float
    memory_bytes: int  # growth of the graphs' private CUDA memory pool (graph_pool_bytes); 0 eagerly
    graphs: bool

    def describe(self) -> str:
        what = "CUDA graphs captured" if self.graphs else "static-shape forwards run (CUDA graphs off)"
        return (f"{self.shapes} {what} at start-up in {self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB; "
                f"other shapes on first use")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static int64 input buffer
    output: UniformOutput  # the static outputs
