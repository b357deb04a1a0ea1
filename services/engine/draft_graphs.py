"""The EAGLE-2 expansion of one sequence replayed from a CUDA graph (or run eagerly).

    graphs = DraftGraphs(head, pool, graphs=True)      # pool: the drafter's PagedKVPool
    cand = graphs.expand(cache, last [H], params)       # Candidates on the CPU (one device-to-host copy)

One graph per (top_k, depth, S key slots), captured on first use into one memory pool; inputs are the
sequence's key rows [S], its committed length [1] and the head output of its last row [H], copied
into the graph's static buffers before each replay. The expansion is `services/spec/tree_static.py`;
`rerank` (host, a few hundred candidates) follows in the drafter. A shape with dynamic depth, or a
batch of several sequences, runs the eager `expand_many` instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from services.model.eagle_head import DraftHead
from services.model.paged_kv import TRASH_ROW, PagedCache, PagedKVPool
from services.model.uniform import capture_graph, key_bucket
from services.spec.tree import Candidates, TreeParams
from services.spec.tree_static import expand_static

log = logging.getLogger(__name__)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    key_rows: torch.Tensor  # [S] long
    stable: torch.Tensor  # [1] long
    last: torch.Tensor  # [H]
    packed: torch.Tensor  # [2 * C + P] float64: scores, tokens, parents (one copy to the host)
    sizes: tuple[int, int, int]


class DraftGraphs:
    def __init__(self, head: DraftHead, pool: PagedKVPool, graphs: bool, max_keys: int = 1 << 16) -> None:
        self.head, self.pool, self.graphs_on = head, pool, graphs
        self.max_keys = max_keys
        head.rotary.tables(max_keys, head.dtype, head.device)  # a graph holds the tables' address
        self._graphs: dict[tuple[int, int, int], _DraftGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if graphs else None
        self.captures, self.capture_s = 0, 0.0
        self.expansions = 0  # expansions served (graph or eager)

    def keys_for(self, cache: PagedCache, params: TreeParams) -> int | None:
        s = key_bucket(cache.length + params.draft_rows)
        return s if s <= self.max_keys else None

    def expand(self, cache: PagedCache, last: torch.Tensor, params: TreeParams, keys: int) -> Candidates:
        """The candidates of `params`' expansion from `last` [H] (head output of the last committed row)."""
        rows = np.full(keys, TRASH_ROW, np.int64)
        m = min(keys, cache.capacity)
        rows[:m] = cache.rows_host[:m]
        key_rows = torch.from_numpy(rows)
        stable = torch.tensor([cache.length], device="cpu")
        k, d = params.top_k, params.depth
        self.expansions += 1
        if not self.graphs_on:
            dev = self.head.device
            cand = expand_static(self.head, self.pool, key_rows.to(dev), stable.to(dev), last, k, d)
            return Candidates(cand.scores.cpu(), cand.tokens.cpu(), cand.parents.cpu())
        g = self._graphs.get((k, d, keys)) or self._capture(k, d, keys)
        g.key_rows.copy_(key_rows, non_blocking=True)
        g.stable.copy_(stable, non_blocking=True)
        g.last.copy_(last)
        g.graph.replay()
        packed = g.packed.cpu()  # the one host copy of the round's draft
        c, _, p = g.sizes
        return Candidates(scores=packed[:c].float(), tokens=packed[c:2 * c].long(), parents=packed[2 * c:].long())

    def _capture(self, k: int, d: int, keys: int) -> _DraftGraph:
        t0 = time.perf_counter()
        dev = self.head.device
        key_rows = torch.full((keys,), TRASH_ROW, dtype=torch.long, device=dev)  # warm-up: the trash page
        stable = torch.zeros(1, dtype=torch.long, device=dev)
        last = torch.zeros(self.head.config.hidden_size, dtype=self.head.dtype, device=dev)

        def run() -> torch.Tensor:
            cand = expand_static(self.head, self.pool, key_rows, stable, last, k, d)
            return torch.cat([cand.scores.double(), cand.tokens.double(), cand.parents.double()])

        graph, packed = capture_graph(run, dev, self._mempool)
        c = k + d * k * k
        g = _DraftGraph(graph, key_rows, stable, last, packed, (c, c, 1 + d * k))
        self._graphs[(k, d, keys)] = g
        dt = time.perf_counter() - t0
        self.captures += 1
        self.capture_s += dt
        log.info("captured the draft expansion top_k=%d depth=%d over %d keys in %.2f s", k, d, keys, dt)
        return g
