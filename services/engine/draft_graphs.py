"""One sequence's EAGLE draft replayed from a CUDA graph (or run eagerly): the head's extension of the
newly committed rows and the EAGLE-2 expansion from the last of them.

    graphs = DraftGraphs(head, pool, graphs=True)       # pool: the drafter's PagedKVPool
    width = graphs.width_for(n)                          # W in EXTEND_WIDTHS, or None (n > 16)
    keys = graphs.keys_for(cache, params, width)         # S key slots, or None (past max_keys)
    cand, last = graphs.draft(cache, features [n, F], tokens [n], params, width, keys)
    cand = graphs.expand(cache, last [H], params, keys)  # rows already extended (eagerly): expansion only
    pending, last = graphs.draft(..., on_device=True)    # PendingCandidates: on the device, host copy queued

One graph per (W, top_k, depth, S key slots) (W = 0: the expansion alone), captured on first use into
one memory pool. Inputs travel in one int64 buffer (one host-to-device copy: the sequence's key rows
[S], the arena rows the extension writes [W], its committed length [1], the new row count [1], the
tokens [W]) and one feature buffer [W, F] (a device copy); the candidates come back in one packed
device-to-host copy. `last` [H] (the head output of the last committed row, which the drafter keeps
for draft_ahead) stays on the device: it is cloned from the graph's output buffer (a device copy,
no host round trip: draft_ahead feeds it to the head on the device). `draft` advances the cache's
length by n; the static code is `services/spec/tree_static.py`; `rerank` (host, a few hundred
candidates) follows in the drafter (with dynamic depth it drops the candidates below the stop: the
graph expands every branch to the full depth). With `on_device` the candidates stay on the device
(PendingCandidates: their host copy is queued into pinned memory, waited for only when the host asks)
so that the drafter can re-rank them there and the verify be queued behind the draft without a sync.
`draft_batch` drafts B sequences of one (top_k, depth) in one graph per (B bucket, W, top_k, depth,
S) (tree_static.draft_batch: one head step a level for all of them, each sequence attending to its
own keys only); B is padded to BATCHES with idle rows that write only to the trash page.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.model.eagle_head import DraftHead
from services.model.paged_kv import TRASH_ROW, PagedCache, PagedKVPool
from services.model.transfer import mark, staged, to_host_queued
from services.model.uniform import MIN_KEYS, WarmUp, bucket, capture_graph, graph_pool_bytes, key_bucket
from services.spec.tree import Candidates, TreeParams
from services.spec.tree_static import draft_batch, draft_static, expand_static

log = logging.getLogger(__name__)

EXTEND_WIDTHS = (1, 2, 4, 8, 16)  # W: newly committed rows a draft graph extends by (padded up)
BATCHES = (2, 4, 8, 16)  # B: sequences a batched draft graph drafts (padded up; more: several graphs)
MAX_DRAFT_GRAPHS = 256  # graphs kept per drafter; shapes beyond run the static code eagerly


@dataclass
class PendingCandidates:
    """A draft's candidates on the device, and their copy to the host in flight: `host()` waits for
    that copy (not for anything queued after it) and unpacks it."""

    device: Candidates  # on the device (views of the packed buffer, converted: queued before any later replay)
    packed: torch.Tensor  # [2C + P] float64 on the host (pinned on CUDA): filled by the queued copy
    done: torch.cuda.Event | None  # recorded after the copy (None: a CPU copy, done already)
    candidates: int  # C

    def host(self) -> Candidates:
        if self.done is not None:
            self.done.synchronize()
        return _split(self.packed, self.candidates)


def _split(packed: torch.Tensor, c: int) -> Candidates:
    """The packed candidates [2C + P] float64 -> Candidates (scores fp32, tokens and parents int64)."""
    return Candidates(scores=packed[:c].float(), tokens=packed[c:2 * c].long(), parents=packed[2 * c:].long())


def _pending(packed: torch.Tensor, c: int) -> PendingCandidates:
    """The candidates of a device buffer `packed` [2C + P] (a graph's output, or the eager static code's)
    left on the device, with their host copy queued behind everything queued so far."""
    host = to_host_queued(packed)
    return PendingCandidates(_split(packed, c), host, mark(packed.device), c)


def _packed(cand: Candidates) -> torch.Tensor:
    """Candidates -> one float64 buffer [2C + P] (one copy to the host; token ids < 2^53 are exact)."""
    return torch.cat([cand.scores.double(), cand.tokens.double(), cand.parents.double()])


def _packed_batch(cand: Candidates) -> torch.Tensor:
    """A batch's candidates ([B, C], [B, C], [B, P]) -> one float64 buffer [B, 2C + P]."""
    return torch.cat([cand.scores.double(), cand.tokens.double(), cand.parents.double()], dim=1)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [S + 2W + 2] long: key_rows [S], write_rows [W], stable, count, tokens [W]
    #                       ([B, S + 2W + 2] for a batch of B)
    features: torch.Tensor  # [W, F] (W = 0: unused; [B, W, F])
    last: torch.Tensor  # [H]: the input of an expansion alone; the extension's output otherwise ([B, H])
    packed: torch.Tensor  # [2 * C + P] float64: scores, tokens, parents (one copy to the host; [B, 2C + P])
    sizes: tuple[int, int, int]


class DraftGraphs:
    def __init__(self, head: DraftHead, pool: PagedKVPool, graphs: bool, max_keys: int = 1 << 16,
                 max_graphs: int = MAX_DRAFT_GRAPHS) -> None:
        self.head, self.pool, self.graphs_on = head, pool, graphs
        self.max_keys, self.max_graphs = max_keys, max_graphs
        self._capped = False
        self._warm: set[tuple[int, int, int, int, int]] = set()  # shapes run eagerly by warm_up (graphs off)
        head.rotary.tables(max_keys, head.dtype, head.device)  # a graph holds the tables' address
        self._graphs: dict[tuple[int, int, int, int, int], _DraftGraph] = {}  # (W, top_k, depth, S, B)
        self._mempool = torch.cuda.graph_pool_handle() if graphs else None
        self.captures, self.capture_s = 0, 0.0
        self.expansions = 0  # expansions served (graph or eager static code)
        self.extensions = 0  # of them, with the extension in the same graph (`draft`)
        self.batched = 0  # of them, drafted with other sequences' (`draft_batch`)

    @staticmethod
    def width_for(n: int) -> int | None:
        """The width bucket of n newly committed rows, or None (wider: the eager extension)."""
        return bucket(n, EXTEND_WIDTHS)

    def keys_for(self, cache: PagedCache, params: TreeParams, width: int = 0) -> int | None:
        """Key slots for the committed rows, `width` new ones and the tree's rows (None: too many)."""
        s = key_bucket(cache.length + width + params.draft_rows)
        return s if s <= self.max_keys else None

    def draft(self, cache: PagedCache, features: torch.Tensor, tokens: torch.Tensor, params: TreeParams,
              width: int, keys: int, on_device: bool = False) -> tuple[Candidates | PendingCandidates, torch.Tensor]:
        """Extend `cache` by the n = len(tokens) <= width committed rows (features [n, F], tokens [n],
        as `tree.extend`) and expand `params` from the last of them -> (candidates on the host, or
        with `on_device` PendingCandidates; last [H] on the device). WARNING: mutates `cache` (n more rows)."""
        n = int(tokens.shape[0])
        assert 1 <= n <= width and keys >= cache.length + width + params.draft_rows, (n, width, keys)
        cache.reserve(n)  # the drafter reserved the slot's rows at start: this only checks them
        host = self._inputs(cache, keys, width, n, tokens)
        k, d = params.top_k, params.depth
        self.expansions += 1
        self.extensions += 1
        g = self._graph(width, k, d, keys)
        if g is None:  # graphs off (or the cap reached): the same static code, eagerly
            dev = self.head.device
            key_rows, write_rows, stable, count, toks = host.to(dev).split((keys, width, 1, 1, width))
            feats = torch.zeros(width, features.shape[1], dtype=self.head.dtype, device=dev)
            feats[:n] = features
            cand, last = draft_static(self.head, self.pool, key_rows, write_rows, stable, count, feats, toks, k, d)
            cache.advance(n)
            return self._out(_packed(cand), int(cand.scores.shape[0]), on_device), last
        g.inputs.copy_(staged(host, g.inputs.device), non_blocking=True)
        g.features[:n].copy_(features)
        if n < width:
            g.features[n:].zero_()  # padded rows: finite inputs (their outputs are dropped)
        g.graph.replay()
        last = g.last.clone()  # the next replay of this graph overwrites its output buffer
        cache.advance(n)
        return self._out(g.packed, g.sizes[0], on_device), last

    def draft_counted(self, cache: PagedCache, features: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor,
                      params: TreeParams, width: int, keys: int) -> tuple[PendingCandidates, torch.Tensor]:
        """`draft` of rows whose number is still on the device: features [W, F], tokens [W] and count [1]
        (n <= W real rows; a verdict's NextRows) -> (PendingCandidates, last [H]). Nothing is read back:
        the write rows past n go to the trash page on the device. The cache's length is NOT advanced:
        the caller advances it by n once the host knows n (the rows written are the logical rows
        length .. length + n - 1, as `draft`'s)."""
        assert keys >= cache.length + width + params.draft_rows and width <= cache.capacity - cache.length
        host = self._inputs(cache, keys, width, width, None)  # every row's arena row; masked below
        k, d = params.top_k, params.depth
        self.expansions += 1
        self.extensions += 1
        g = self._graph(width, k, d, keys)
        dev = self.head.device
        inputs = g.inputs.copy_(staged(host, dev), non_blocking=True) if g is not None else host.to(dev)
        key_rows, write_rows, stable, n, toks = inputs.split((keys, width, 1, 1, width))
        write_rows.copy_(torch.where(torch.arange(width, device=dev) < count, write_rows, TRASH_ROW))
        n.copy_(count)
        toks.copy_(tokens)
        if g is None:
            cand, last = draft_static(self.head, self.pool, key_rows, write_rows, stable, n, features, toks, k, d)
            return _pending(_packed(cand), int(cand.scores.shape[0])), last
        g.features.copy_(features)
        g.graph.replay()
        return _pending(g.packed, g.sizes[0]), g.last.clone()

    def draft_batch(self, caches: list[PagedCache], features: list[torch.Tensor], tokens: list[torch.Tensor],
                    params: TreeParams, width: int, keys: int) -> tuple[list[Candidates], list[torch.Tensor]]:
        """`draft` for B <= BATCHES[-1] sequences of one shape at once: features[i] [n_i, F], tokens[i]
        [n_i] (n_i <= width), every cache within `keys` -> (each one's candidates on the host, each
        one's last [H] on the device). One graph per (B bucket, W, top_k, depth, S): the head's
        weights are read once a level for the batch. WARNING: advances each cache by its n_i."""
        b = len(caches)
        size = bucket(b, BATCHES)
        assert size is not None and b > 1, b
        rows = []
        for cache, toks in zip(caches, tokens, strict=True):
            n = int(toks.shape[0])
            assert 1 <= n <= width and keys >= cache.length + width + params.draft_rows, (n, width, keys)
            cache.reserve(n)
            rows.append(self._inputs(cache, keys, width, n, toks))
        rows += [self._idle_inputs(keys, width)] * (size - b)
        host = torch.stack(rows)  # [B, S + 2W + 2]
        k, d = params.top_k, params.depth
        self.expansions += b
        self.extensions += b
        self.batched += b
        g = self._graph(width, k, d, keys, size)
        dev = self.head.device
        if g is None:  # graphs off (or the cap reached): the same static code, eagerly
            inputs = host.to(dev)
            feats = torch.zeros(size, width, self.head.config.feature_size, dtype=self.head.dtype, device=dev)
        else:
            inputs = g.inputs.copy_(staged(host, dev), non_blocking=True)
            feats = g.features.zero_()  # padded rows: finite inputs (their outputs are dropped)
        for i, f in enumerate(features):
            feats[i, :f.shape[0]].copy_(f)
        if g is None:
            key_rows, write_rows, stable, count, toks = inputs.split((keys, width, 1, 1, width), dim=1)
            cand, last = draft_batch(self.head, self.pool, key_rows, write_rows, stable[:, 0], count[:, 0], feats,
                                     toks, k, d)
            packed = _packed_batch(cand)
        else:
            g.graph.replay()
            packed, last = g.packed, g.last.clone()
        for cache, toks in zip(caches, tokens, strict=True):
            cache.advance(int(toks.shape[0]))
        out = packed.cpu()  # the batch's one copy of its drafts
        c = k + d * k * k
        return [_split(out[i], c) for i in range(b)], list(last[:b].unbind(0))

    def expand(self, cache: PagedCache, last: torch.Tensor, params: TreeParams, keys: int,
               on_device: bool = False) -> Candidates | PendingCandidates:
        """The candidates of `params`' expansion from `last` [H] (head output of the last committed
        row; the rows were extended before, eagerly): on the host, or PendingCandidates (`on_device`)."""
        host = self._inputs(cache, keys, 0, 0, None)
        k, d = params.top_k, params.depth
        self.expansions += 1
        g = self._graph(0, k, d, keys)
        if g is None:
            dev = self.head.device
            key_rows, stable, _ = host.to(dev).split((keys, 1, 1))
            cand = expand_static(self.head, self.pool, key_rows, stable, last, k, d)
            return self._out(_packed(cand), int(cand.scores.shape[0]), on_device)
        g.inputs.copy_(staged(host, g.inputs.device), non_blocking=True)
        g.last.copy_(last)
        g.graph.replay()
        return self._out(g.packed, g.sizes[0], on_device)

    def _graph(self, width: int, k: int, d: int, keys: int, batch: int = 1) -> _DraftGraph | None:
        """The graph of this shape (captured now on first use), or None: graphs off, or `max_graphs`
        captured already (the adaptive budget's shapes times the width and key buckets could
        otherwise capture without end): then the static code runs eagerly, logged once."""
        if not self.graphs_on:
            return None
        g = self._graphs.get((width, k, d, keys, batch))
        if g is not None:
            return g
        if len(self._graphs) >= self.max_graphs:
            if not self._capped:
                self._capped = True
                log.warning("%d draft graphs captured: further draft shapes run eagerly", self.max_graphs)
            return None
        return self._capture(width, k, d, keys, batch)

    def _inputs(self, cache: PagedCache, keys: int, width: int, n: int, tokens: torch.Tensor | None
                ) -> torch.Tensor:
        """The int64 input buffer (host): key_rows [S], write_rows [W], stable, count, tokens [W].
        Example: rows_host [40..47, 8..15] (pages 5, 1 of size 8), length 7, n 2, W 4, S 256 ->
        key_rows [40..47, 8..15, 0 x 240], write_rows [47, 8, 0, 0], stable 7, count 2."""
        p = cache.length
        key_rows = np.full(keys, TRASH_ROW, np.int64)
        m = min(keys, cache.capacity)
        key_rows[:m] = cache.rows_host[:m]
        write_rows = np.full(width, TRASH_ROW, np.int64)
        write_rows[:n] = cache.rows_host[p:p + n]
        toks = np.zeros(width, np.int64)
        if tokens is not None:
            toks[:n] = tokens.cpu().numpy()
        return torch.from_numpy(np.concatenate([key_rows, write_rows, np.array([p, n], np.int64), toks]))

    @staticmethod
    def _out(packed: torch.Tensor, c: int, on_device: bool) -> Candidates | PendingCandidates:
        """The candidates in `packed` (device) [2C + P]: copied to the host now (the round's one copy of
        its draft), or left on the device with that copy queued (`on_device`)."""
        return _pending(packed, c) if on_device else _split(packed.cpu(), c)

    def warm_up(self, params: TreeParams, keys: int = MIN_KEYS, max_batch: int = 1) -> WarmUp:
        """Before any request: the shapes of `params` (the drafter's own tree) at every extension width
        and the expansion alone, over the first key bucket, and with `max_batch` > 1 the batched drafts
        (`draft_batch`) of every batch bucket up to it (the bucket that holds it; BATCHES[-1] at most)
        at every extension width: each captured (or, graphs off, run once eagerly: the head's fused
        stages compile). Every write goes to the trash page."""
        t0 = time.perf_counter()
        held = graph_pool_bytes(self._mempool)
        top = bucket(min(max_batch, BATCHES[-1]), BATCHES) if max_batch > 1 else 1
        shapes = [(width, params.top_k, params.depth, keys, 1) for width in (0, *EXTEND_WIDTHS)]
        shapes += [(width, params.top_k, params.depth, keys, b) for b in BATCHES if b <= (top or 1)
                   for width in EXTEND_WIDTHS]
        done = 0
        for shape in shapes:
            if shape in self._graphs or shape in self._warm:
                continue
            if self.graphs_on:
                if self._graph(*shape) is None:  # the cap
                    break
            else:
                self._idle_run(*shape)[0]()
                self._warm.add(shape)
            done += 1
        return WarmUp(done, time.perf_counter() - t0, graph_pool_bytes(self._mempool) - held, self.graphs_on)

    @staticmethod
    def _idle_inputs(keys: int, width: int) -> torch.Tensor:
        """The int64 inputs [S + 2W + 2] of an idle row: every write to the trash page, no committed row,
        one new row (a batch's padding; a capture's inputs)."""
        idle = torch.full((keys + 2 * width + 2,), TRASH_ROW, dtype=torch.long)
        idle[keys + width:] = 0
        idle[keys + width + 1] = 1 if width else 0
        return idle

    def _idle_run(self, width: int, k: int, d: int, keys: int, batch: int = 1
                  ) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """The static draft of this shape over idle inputs (`_idle_inputs`) -> (a function running it
        -> (packed candidates, last), its int64 input buffer, its feature buffer [W, F]); a batch of
        B > 1 (`draft_batch`, W > 0): [B, ...] of each."""
        head, dev = self.head, self.head.device
        f = head.config.feature_size
        if batch > 1:
            inputs = self._idle_inputs(keys, width).repeat(batch, 1).to(dev)
            key_rows, write_rows, stable, count, tokens = inputs.split((keys, width, 1, 1, width), dim=1)
            feats = torch.zeros(batch, width, f, dtype=head.dtype, device=dev)

            def run_batch() -> tuple[torch.Tensor, torch.Tensor]:
                cand, last = draft_batch(head, self.pool, key_rows, write_rows, stable[:, 0], count[:, 0], feats,
                                         tokens, k, d)
                return _packed_batch(cand), last

            return run_batch, inputs, feats
        inputs = self._idle_inputs(keys, width).to(dev)
        key_rows, write_rows, stable, count, tokens = inputs.split((keys, width, 1, 1, width))
        features = torch.zeros(width, f, dtype=head.dtype, device=dev)
        last_in = torch.zeros(head.config.hidden_size, dtype=head.dtype, device=dev)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            if width:
                cand, last = draft_static(head, self.pool, key_rows, write_rows, stable, count, features, tokens, k, d)
            else:
                cand, last = expand_static(head, self.pool, key_rows, stable, last_in, k, d), last_in
            return _packed(cand), last

        return run, inputs, features

    def _capture(self, width: int, k: int, d: int, keys: int, batch: int = 1) -> _DraftGraph:
        t0 = time.perf_counter()
        dev = self.head.device
        run, inputs, features = self._idle_run(width, k, d, keys, batch)
        graph, (packed, last_out) = capture_graph(run, dev, self._mempool)
        c = k + d * k * k
        g = _DraftGraph(graph, inputs, features, last_out, packed, (c, c, 1 + d * k))
        self._graphs[(width, k, d, keys, batch)] = g
        dt = time.perf_counter() - t0
        self.captures += 1
        self.capture_s += dt
        what = f"extension of {width} row(s) + expansion" if width else "expansion"
        log.info("captured the draft %s top_k=%d depth=%d over %d keys%s in %.2f s", what, k, d, keys,
                 f" for {batch} sequences" if batch > 1 else "", dt)
        return g
