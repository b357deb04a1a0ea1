"""Drafter: holds an EAGLE head and a draft KV per sequence, and grows the EAGLE-2 tree.

`draft` grows one sequence's tree; `draft_many` grows many sequences' trees with one head step per
level for all of them (the drafter service gathers concurrent calls into it).

The in-process implementation of the drafter role; the drafter service wraps this class unchanged.
It does not know the target model, sampling or stop rules.

On CUDA the draft KV of every sequence lives in one paged arena (services/model/paged_kv.py), and a
single sequence's draft is replayed from a CUDA graph per (top_k, depth) (services/engine/draft_graphs.py;
AERIE_CUDA_GRAPHS=0: the same static code eagerly): the extension of up to 16 newly committed rows
and the expansion in one graph, or (more rows) the eager extension and then the expansion's graph;
a tree with dynamic depth expands every branch there and `rerank` applies the stop (`_static`);
several sequences of one (top_k, depth) with up to 16 new rows each draft together in one graph per
batch bucket (`_draft_batch`: DraftGraphs.draft_batch); other batches and draft_ahead run the eager
code over the same pages.
On the CPU: contiguous caches, eager, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.draft_graphs import BATCHES, EXTEND_WIDTHS, PendingCandidates
from services.errors import (
    ROWS_MISSING,
    AerieError,
    CapacityExceeded,
    DraftRowsMissing,
    InvalidRequest,
    KVBudgetExceeded,
    SequenceNotFound,
)
from services.model.eagle_head import DraftHead
from services.model.kv_cache import KVRows
from services.model.paged_kv import PagedCache, PagedKVPool
from services.model.transfer import mark, to_host_queued
from services.model.uniform import WarmUp
from services.spec.ahead_tree import ahead_rows, expand_branches
from services.spec.tree import DraftTree, TreeOnDevice, TreeParams, expand, expand_many, extend_many, rerank
from services.spec.tree_static import rerank_static
from services.spec.verify import NextRows

if TYPE_CHECKING:
    from services.engine.roles import FeatureKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VerdictDraft:
    """A tree drafted from a verdict still on the device (Drafter.draft_from_verdict), and that verdict's
    rows on their way to the host."""

    tree: TreeOnDevice | None  # None: not re-ranked yet (Drafter.redraft re-ranks it to the plan)
    rows: torch.Tensor  # [1 + W] host: count, then the W row tokens (valid after `copied`)
    copied: torch.cuda.Event | None  # recorded after the rows' copy, before the draft (None: CPU)
    params: TreeParams  # the shape drafted: the verified round's own (the guess of the next plan)
    candidates: PendingCandidates  # that expansion's candidates (a re-rank to another size or stop)

    def matches(self, tokens: list[int]) -> bool:
        """Whether the rows the draft KV took are `tokens` (the round's accepted tokens + bonus, as the
        host read the verdict). Waits for the rows' copy only (not for the draft queued after it)."""
        if self.copied is not None:
            self.copied.synchronize()
        n = int(self.rows[0])
        return n == len(tokens) and self.rows[1:1 + n].tolist() == tokens


@dataclass(frozen=True, slots=True)
class DraftCall:
    seq_id: str
    tokens: torch.Tensor  # [n] newly committed tokens shifted by one (last = the root)
    features: torch.Tensor  # [n, F] target features of the rows before them
    params: TreeParams | None = None  # this round's shape (None = the drafter's largest)
    # the draft KV row tokens[0] goes to: rows past it are dropped first (a DraftAhead its caller left
    # took them: the same rows); None: after the rows the KV holds. Fewer rows: DraftRowsMissing
    first_row: int | None = None


class Drafter:
    """`tree` is the largest shape a call may ask for (it sizes the draft KV); `draft(..., params)`
    grows any shape it covers (the budget picks one per round), `params=None` grows `tree` itself."""

    def __init__(self, head: DraftHead, tree: TreeParams, max_sequences: int = 64, ahead_branches: int = 0) -> None:
        """`ahead_branches`: the most branches (likely bonuses) per attach point an ahead tree may grow
        a fresh-sized subtree under (services/spec/ahead_tree.py); each sequence's draft KV reserves
        their rows, so it is 0 (the single ahead tree, no reservation) unless drafting ahead is on:
        an Engine built with `ahead` raises it to its policy's `branches` before any sequence starts."""
        if tree.top_k > head.draft_vocab_size:
            raise InvalidRequest(
                f"top_k={tree.top_k} (--tree-top-k) exceeds the draft vocabulary ({head.draft_vocab_size})")
        self.head = head
        self.tree = tree
        self.max_sequences = max_sequences
        if ahead_branches < 0:
            raise InvalidRequest(f"ahead_branches must be >= 0; got {ahead_branches}")
        self.ahead_branches = ahead_branches
        self._caches: dict[str, KVRows] = {}  # KVCache, or a PagedCache on CUDA
        self._slots: dict[str, int] = {}  # paged: the sequence's slot in `pool`
        self._sort_paths: dict[str, bool] = {}
        # committed rows + one tree expansion: a draft's limit (the KV adds the ahead draft's slack)
        self._rows: dict[str, int] = {}
        self._last: dict[str, torch.Tensor] = {}  # [H] head output of the last committed row (draft_ahead)
        # the latest eager expansion of each sequence (the tree in flight's): its root's index (the draft KV
        # length when its root row was the last) and its head outputs by token path from the root (the
        # root's, the chain's, every expanded node's). draft_ahead feeds them to the guess's and the chain's
        # rows: one head step for all of them instead of one each (only with ahead_branches > 0: a drafter
        # that drafts ahead; the static and batched graphs record nothing)
        self._flight: dict[str, tuple[int, int, dict[tuple[int, ...], torch.Tensor]]] = {}  # (root's index, root, ...)
        self.reuse_flight = True  # False: draft_ahead runs the guess's and the chain's rows one by one
        self.pool: PagedKVPool | None = None
        self.graphs = None
        # the extension inside the draft graph (DraftGraphs.draft); off after it failed once on a device
        self.extend_in_graph = True
        # several sequences' drafts in one static draft (_draft_batch); off after it failed once on a device
        self.batch_in_graph = True
        from services.model.runner import paged_default

        if paged_default(head.device):  # CUDA (on the CPU with AERIE_PAGED_KV=1: the same code, eagerly)
            from services.engine.draft_graphs import DraftGraphs
            from services.model.runner import graphs_default

            c = head.config
            per_row = 2 * c.num_kv_heads * c.head_dim * torch.empty((), dtype=head.dtype).element_size()
            free = torch.cuda.mem_get_info(head.device)[0] if head.device.type == "cuda" else 1 << 30  # CPU: 1 GiB
            rows = max(4096, min(max_sequences * 8192, int(free * 0.1) // per_row))
            self.pool = PagedKVPool(1, c.num_kv_heads, c.head_dim, rows, head.dtype, head.device)
            self.graphs = DraftGraphs(head, self.pool, graphs=graphs_default(head.device))

    @property
    def feature_kind(self) -> FeatureKind:
        return self.head.feature_kind

    @property
    def device(self) -> torch.device:
        return self.head.device

    def warm_up(self, max_sequences: int = 0) -> WarmUp | None:
        """Before the first request (CUDA only: None elsewhere): the draft graphs of the drafter's own
        tree (`DraftGraphs.warm_up`: every extension width and the expansion alone, the first key
        bucket), and where `max_sequences` (the start-up hook's: services/model/runner.py
        warm_up_at_start) allows batches, the batched drafts of that tree up to it. The adaptive
        budget's other shapes are captured when first asked for."""
        if self.graphs is None or self.tree.depth < 1:
            return None
        batch = min(max_sequences, self.max_sequences) if self.batch_in_graph else 1
        return self.graphs.warm_up(self.tree, max_batch=batch)

    def start(self, seq_id: str, max_rows: int, sampling: bool) -> None:
        """Reserve a draft KV for up to `max_rows` committed rows plus one tree expansion."""
        if seq_id in self._caches:
            raise InvalidRequest(f"sequence {seq_id!r} already exists on this drafter")
        if len(self._caches) >= self.max_sequences:
            raise CapacityExceeded(f"drafter holds its maximum of {self.max_sequences} sequences")
        # one tree expansion, or draft_ahead's guessed and chain rows (at most depth + 2 and depth + 1)
        # and its branches (at the root and at every chain node)
        d = self.tree.depth
        rows = max_rows + max(self.tree.draft_rows, 2 * d + 3 + ahead_rows(self.tree, (d + 2) * self.ahead_branches))
        cache: KVRows | None = None
        if self.pool is not None:
            try:
                slot = self.pool.allocate(rows)
                self._slots[seq_id] = slot
                cache = self.pool.cache(slot)
            except KVBudgetExceeded:  # the arena is full: a contiguous cache of its own, eager drafts
                cache = None
        self._caches[seq_id] = cache if cache is not None else self.head.new_cache(rows)
        self._sort_paths[seq_id] = sampling
        self._rows[seq_id] = max_rows + self.tree.draft_rows

    def check_params(self, params: TreeParams) -> None:
        if not self.tree.covers(params):
            raise InvalidRequest(
                f"tree shape top_k={params.top_k}, depth={params.depth}, size={params.size} exceeds "
                f"this drafter's largest shape top_k={self.tree.top_k}, depth={self.tree.depth}, "
                f"size={self.tree.size} (its draft KV is sized for that)")
        if params.top_k > self.head.config.draft_vocab:
            raise InvalidRequest(
                f"top_k={params.top_k} (--tree-top-k) exceeds the draft vocabulary ({self.head.config.draft_vocab})")

    @property
    def drafts_on_device(self) -> bool:
        """Whether `draft_on_device` can leave a tree on the device (the static draft: a
        paged draft KV, CUDA or a test's CPU arena)."""
        return self.graphs is not None

    def draft(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
              params: TreeParams | None = None) -> DraftTree:
        """tokens [n] newly committed tokens shifted by one (last = root); features [n, F];
        `params` this round's shape (None = the largest)."""
        out = self.draft_many([DraftCall(seq_id, tokens, features, params)])[0]
        if isinstance(out, BaseException):
            raise out
        assert isinstance(out, DraftTree)  # (on the host: draft_many without on_device)
        return out

    def draft_on_device(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor,
                        params: TreeParams | None = None) -> DraftTree | TreeOnDevice:
        """`draft`, re-ranked on the device where the static draft runs: a TreeOnDevice (nothing read
        back; the caller queues the verify behind it; in process only); elsewhere the host tree."""
        out = self.draft_many([DraftCall(seq_id, tokens, features, params)], on_device=True)[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def draft_many(self, calls: list[DraftCall], on_device: bool = False
                   ) -> list[DraftTree | TreeOnDevice | AerieError]:
        """Grow the trees of many sequences with one head step per level (tree.grow_trees), in
        order; an invalid call's error takes its place and the others draft without it. `on_device`:
        a single sequence's static draft leaves its tree on the device (`draft`)."""
        results: list[DraftTree | TreeOnDevice | AerieError | None] = [None] * len(calls)
        valid: list[int] = []
        shapes: list[TreeParams] = []
        seen: set[str] = set()
        for i, call in enumerate(calls):
            try:
                if call.seq_id in seen:
                    raise InvalidRequest(f"sequence {call.seq_id!r} has two draft calls in one batch")
                self._cache(call.seq_id)
                params = self.tree if call.params is None else call.params
                if call.params is not None:
                    self.check_params(params)
                f = self.head.config.feature_size
                n = call.tokens.shape[0] if call.tokens.ndim == 1 else -1
                if n < 1 or call.features.ndim != 2 or call.features.shape != (n, f):
                    raise InvalidRequest(
                        f"features must have shape [{n}, {f}]; got {list(call.features.shape)}")
                cache, rows = self._caches[call.seq_id], self._rows[call.seq_id]
                if call.first_row is not None:
                    self._realign(call.seq_id, cache, call.first_row)
                if cache.length + n + params.draft_rows > rows:  # checked here: fails alone
                    raise CapacityExceeded(
                        f"draft KV of sequence {call.seq_id!r} holds {rows} rows; {cache.length} used, "
                        f"{n} committed rows and {params.draft_rows} tree rows requested")
            except AerieError as e:
                results[i] = e
                continue
            seen.add(call.seq_id)
            valid.append(i)
            shapes.append(params)
            self._flight.pop(call.seq_id, None)  # (the eager expansion below records a new one)
        if len(valid) == 1 and self._static(calls[valid[0]].seq_id, shapes[0]):
            call = calls[valid[0]]
            results[valid[0]] = self._draft_static(call, shapes[0], on_device)
        elif valid:
            groups: dict[tuple[int, int], list[int]] = {}  # (top_k, depth) -> positions in `valid`
            for j, i in enumerate(valid):
                if self._batchable(calls[i], shapes[j]):
                    groups.setdefault((shapes[j].top_k, shapes[j].depth), []).append(j)
            for js in groups.values():  # each shape's sequences drafted together (one alone: its own graph)
                trees = self._draft_batch([calls[valid[j]] for j in js], [shapes[j] for j in js])
                for j, tree in zip(js, trees, strict=True):
                    results[valid[j]] = tree  # (None: its batch failed; drafted eagerly below)
            eager = [j for j in range(len(valid)) if results[valid[j]] is None]
            if eager:
                dev = self.head.device
                caches = [self._caches[calls[valid[j]].seq_id] for j in eager]
                lasts = extend_many(self.head, caches, [calls[valid[j]].features.to(dev) for j in eager],
                                    [calls[valid[j]].tokens.to(dev) for j in eager])  # (tree.grow_trees)
                records: list[dict] | None = [{} for _ in eager] if self.ahead_branches else None
                cands = expand_many(self.head, caches, lasts, [shapes[j] for j in eager], records)
                for n, (j, last, cand) in enumerate(zip(eager, lasts, cands, strict=True)):
                    call = calls[valid[j]]
                    self._last[call.seq_id] = last
                    if records is not None:
                        self._flight[call.seq_id] = (caches[n].length, int(call.tokens[-1]), records[n])
                    results[valid[j]] = rerank(cand, int(call.tokens[-1]), shapes[j], self._sort_paths[call.seq_id])
        return results  # type: ignore[return-value]

    def _static(self, seq_id: str, params: TreeParams) -> bool:
        """The graph-replayed draft applies: CUDA, a paged cache, a tree of depth > 0 within the
        graphs' keys. Dynamic depth too (the budget's trees): the graph expands every branch to the
        full depth and `rerank` drops what falls below the stop, which is the tree the eager beam
        gives (services/spec/tree.py, "Dynamic depth"), at the cost of the pruned branches' rows."""
        cache = self._caches[seq_id]
        return (self.graphs is not None and isinstance(cache, PagedCache) and params.depth > 0
                and self.graphs.keys_for(cache, params) is not None)

    def _batchable(self, call: DraftCall, params: TreeParams) -> bool:
        """A call of a batch that the static draft takes (`_draft_batch`, with the other calls of its
        top_k and depth): a paged cache, depth > 0, at most 16 new rows, within the graphs' keys at
        the widest extension; else the eager batch."""
        cache = self._caches[call.seq_id]
        return (self.graphs is not None and self.extend_in_graph and self.batch_in_graph
                and isinstance(cache, PagedCache)
                and params.depth > 0 and self.graphs.width_for(int(call.tokens.shape[0])) is not None
                and self.graphs.keys_for(cache, params, EXTEND_WIDTHS[-1]) is not None)

    def _draft_batch(self, calls: list[DraftCall], shapes: list[TreeParams]) -> list[DraftTree | None]:
        """The drafts of several sequences of one (top_k, depth) from the static code for all of them at
        once (DraftGraphs.draft_batch: a graph per batch bucket on CUDA), BATCHES[-1] at a time (one
        alone: its own draft graph); each tree re-ranked on the host to its own size and stop. None
        for the calls of a batch whose graph failed on the device (rolled back: the caller drafts them
        eagerly; logged once, and no batch drafts together again)."""
        assert self.graphs is not None  # (_batchable)
        dev, params = self.head.device, shapes[0]
        trees: list[DraftTree | None] = []
        for at in range(0, len(calls), BATCHES[-1]):
            group = calls[at:at + BATCHES[-1]]
            if len(group) == 1:  # (the remainder of a large batch)
                tree = self._draft_static(group[0], shapes[at])
                assert isinstance(tree, DraftTree)  # (not on_device)
                trees.append(tree)
                continue
            caches: list[PagedCache] = [self._caches[c.seq_id] for c in group]  # type: ignore[misc]
            width = self.graphs.width_for(max(int(c.tokens.shape[0]) for c in group))
            assert width is not None  # (_batchable)
            keys = max(self.graphs.keys_for(cache, params, width) or 0 for cache in caches)
            lengths = [cache.length for cache in caches]
            try:
                cands, lasts = self.graphs.draft_batch(caches, [c.features.to(dev) for c in group],
                                                       [c.tokens for c in group], params, width, keys)
            except RuntimeError:  # a device error in the batched graph: keep serving on the eager batch
                log.exception("the batched draft graph failed; this drafter drafts batches eagerly from now on")
                self.batch_in_graph = False
                for cache, length in zip(caches, lengths, strict=True):
                    cache.truncate(length)  # the eager batch writes the same rows again
                trees += [None] * len(group)
                continue
            for call, shape, cand, last in zip(group, shapes[at:at + len(group)], cands, lasts, strict=True):
                self._last[call.seq_id] = last
                trees.append(rerank(cand, int(call.tokens[-1]), shape, self._sort_paths[call.seq_id]))
        return trees

    def _draft_static(self, call: DraftCall, params: TreeParams, on_device: bool = False) -> DraftTree | TreeOnDevice:
        """One sequence's draft from the static code (a CUDA graph, or eagerly with graphs off): the
        extension and the expansion in one graph when the n new rows fit a width bucket (<= 16) and
        the key slots, else the eager extension and then the expansion's graph (or eager code).
        `on_device`: re-ranked on the device (a TreeOnDevice) unless the eager beam drafted it."""
        dev = self.head.device
        cache, graphs = self._caches[call.seq_id], self.graphs
        assert graphs is not None and isinstance(cache, PagedCache), "checked by _static"
        width = graphs.width_for(int(call.tokens.shape[0]))
        keys = graphs.keys_for(cache, params, width) if width is not None else None
        cand = None
        if width is not None and keys is not None and self.extend_in_graph:
            length = cache.length
            try:
                cand, last = graphs.draft(cache, call.features, call.tokens, params, width, keys, on_device)
            except RuntimeError:  # a device error in the combined graph: keep serving on the older path
                log.exception("the draft graph with the extension failed; this drafter extends eagerly from now on")
                self.extend_in_graph = False
                cache.truncate(length)  # the eager extension below writes the same rows again
        if cand is None:
            last = extend_many(self.head, [cache], [call.features.to(dev)], [call.tokens.to(dev)])[0]
            keys = graphs.keys_for(cache, params)  # after the extension: the rows the expansion reads
            # (None: the extension took the sequence past the graphs' largest key count: eagerly, then)
            cand = (graphs.expand(cache, last, params, keys, on_device) if keys is not None
                    else expand(self.head, cache, last, params))
        self._last[call.seq_id] = last
        root, sort_paths = int(call.tokens[-1]), self._sort_paths[call.seq_id]
        if isinstance(cand, PendingCandidates):
            pending = cand
            return TreeOnDevice(rerank_static(pending.device, root, params),
                                lambda: rerank(pending.host(), root, params, sort_paths))
        return rerank(cand, root, params, sort_paths)

    def next_width(self, params: TreeParams) -> int | None:
        """The extension width of a draft queued from a verdict (`draft_from_verdict`): the rows of the
        longest accept of a `params` tree (depth + 2), in a width bucket; None past the largest."""
        return self.graphs.width_for(params.depth + 2) if self.graphs is not None else None

    def draft_from_verdict(self, seq_id: str, rows: NextRows, features: torch.Tensor, params: TreeParams,
                           ranked: bool = True) -> VerdictDraft | None:
        """The next tree queued from a greedy verdict still on the device (rows: its NextRows of width
        `next_width(params)`; features [W, F] the target features of their nodes), re-ranked on the
        device (`ranked` False: the candidates only, for a `redraft` once the plan is known; the
        adaptive budget's plans change their stop every round): nothing is read back. The draft KV
        takes the rows (logical rows length .. length + n - 1) but its length moves only with
        `commit(seq_id, n)`, once the host has the verdict; a verdict the host reads differently is
        dropped by not committing it (the next draft writes those rows again).
        None where the static draft or its rows do not fit (then draft as usual after the verdict)."""
        cache = self._cache(seq_id)
        width = self.next_width(params)
        if width is None or not self.extend_in_graph or not self._static(seq_id, params):
            return None
        assert self.graphs is not None and isinstance(cache, PagedCache)  # (_static)
        keys = self.graphs.keys_for(cache, params, width)
        if (keys is None or cache.length + width + params.draft_rows > self._rows[seq_id]
                or cache.length + width > cache.capacity):
            return None
        verdict = to_host_queued(torch.cat([rows.count, rows.tokens]))  # before the draft's candidates
        copied = mark(rows.tokens.device)
        pending, last = self.graphs.draft_counted(cache, features, rows.tokens, rows.count, params, width, keys)
        self._last[seq_id] = last
        self._flight.pop(seq_id, None)
        root = rows.tokens[rows.count - 1]  # [1] the bonus: the tree's root, on the device
        sort_paths = self._sort_paths[seq_id]

        def host() -> DraftTree:
            cand = pending.host()  # (the verdict's copy was queued before it: here too)
            return rerank(cand, int(verdict[int(verdict[0])]), params, sort_paths)

        tree = TreeOnDevice(rerank_static(pending.device, root, params), host) if ranked else None
        return VerdictDraft(tree, verdict, copied, params, pending)

    def commit(self, seq_id: str, n: int) -> None:
        """The host's verdict matched the rows a `draft_from_verdict` extended the draft KV by: keep n."""
        self._cache(seq_id).advance(n)

    def redraft(self, seq_id: str, verdict: VerdictDraft, params: TreeParams, root: int) -> DraftTree | TreeOnDevice:
        """After `commit`, the tree of shape `params` where the plan made after the verdict is not the
        shape the verdict's draft guessed (the adaptive budget's next plan): the same candidates
        re-ranked on the device when only the size or the stop differs (same top_k and depth), else
        an expansion alone from the committed rows (the verdict's rows stay in the draft KV: no
        second extension); the eager expansion and a host tree where the static draft does not apply.
        `root`: the bonus (the tree's root)."""
        self.check_params(params)
        cache, sort_paths = self._cache(seq_id), self._sort_paths[seq_id]
        if cache.length + params.draft_rows > self._rows[seq_id]:
            raise CapacityExceeded(f"draft KV of sequence {seq_id!r} holds {self._rows[seq_id]} rows; "
                                   f"{cache.length} used and {params.draft_rows} tree rows requested")
        if (params.top_k, params.depth) == (verdict.params.top_k, verdict.params.depth):
            cand = verdict.candidates
        else:
            last = self._last[seq_id]
            if not self._static(seq_id, params):
                return rerank(expand(self.head, cache, last, params), root, params, sort_paths)
            assert self.graphs is not None and isinstance(cache, PagedCache)  # (_static)
            keys = self.graphs.keys_for(cache, params)
            assert keys is not None  # (_static)
            out = self.graphs.expand(cache, last, params, keys, on_device=True)
            assert isinstance(out, PendingCandidates)  # (on_device)
            cand = out
        return TreeOnDevice(rerank_static(cand.device, root, params),
                            lambda: rerank(cand.host(), root, params, sort_paths))

    def draft_ahead(self, seq_id: str, tokens: torch.Tensor, features: torch.Tensor, guess: list[int],
                    params: TreeParams | None = None, round_index: int = 0, branches: int | None = None,
                    exclude: tuple[tuple[int, ...], ...] = (), chain: tuple[int, ...] = ()) -> DraftTree | None:
        """Grow the ahead tree from a guessed verdict (services/spec/ahead.py) while the current tree
        is verified. tokens [n] / features [n, F]: committed rows the draft KV has not seen (n may be
        0: the KV is current); they are committed to the draft KV like a `draft` call's. Then each
        guessed token gets a row fed with the head's own predicted feature of the row before it, the
        tree is expanded from the last guessed row and rooted at the guess's last token, and the
        guessed rows are dropped: the draft KV again holds only committed rows with target features.
        The guess and the chain are a path of the tree in flight, which this drafter expanded: where
        its expansion recorded the head outputs along that path (`_flight`), they are the rows'
        predicted features and every row goes in one head step (causal); else one head step a row.
        `branches` (None: this drafter's `ahead_branches`; capped by it and by the free KV rows):
        > 0 grows a fresh-sized subtree of shape `params` under each of that many likely bonuses at
        the root and at each node of `chain` (the tree in flight's top path past the guess, a path
        of the ahead tree; cut short where the KV has no room), skipping `exclude[p]` at the root
        (p = 0) and at chain node p (services/spec/ahead_tree.py: a hit reroots to the round's own
        depth and size); 0 grows one tree of shape `params` (the bonus's subtree is then a level
        or more shallower; no chain).
        None if the guess's rows do not fit the draft KV. `round_index`: the round that will verify
        the ahead tree (the gRPC path's tracing; unused here).
        Eager on every device (the CUDA graphs replay fixed-shape expansions of committed rows only)."""
        cache = self._cache(seq_id)
        params = self.tree if params is None else params
        self.check_params(params)
        if not 1 <= len(guess) <= self.tree.depth + 2:
            raise InvalidRequest(f"a guess has 1..{self.tree.depth + 2} tokens; got {len(guess)}")
        branches = self.ahead_branches if branches is None else branches
        if branches < 0:
            raise InvalidRequest(f"branches must be >= 0; got {branches}")
        dev = self.head.device
        n = int(tokens.shape[0])
        flight = self._flight.pop(seq_id, None)  # (this call's expansion records the next one)
        if cache.length + n > self._rows[seq_id]:
            raise CapacityExceeded(f"draft KV of sequence {seq_id!r} holds {self._rows[seq_id]} rows; "
                                   f"{cache.length} used, {n} committed rows requested")
        if n:
            f = self.head.config.feature_size
            if features.shape != (n, f):
                raise InvalidRequest(f"features must have shape [{n}, {f}]; got {list(features.shape)}")
            self._last[seq_id] = extend_many(self.head, [cache], [features.to(dev)], [tokens.to(dev)])[0]
        last = self._last.get(seq_id)
        if last is None:
            raise InvalidRequest(f"sequence {seq_id!r} has no committed draft rows yet: draft before drafting ahead")
        if len(chain) > self.tree.depth + 1:
            raise InvalidRequest(f"a chain has at most {self.tree.depth + 1} tokens; got {len(chain)}")
        if len(exclude) > len(chain) + 1:
            raise InvalidRequest(f"exclude has one list per attach point (the root and each chain token: "
                                 f"{len(chain) + 1}); got {len(exclude)}")
        free = cache.capacity - cache.length - len(guess)
        branches = min(branches, self.ahead_branches)
        chain = tuple(chain) if branches else ()
        while branches and len(chain) + ahead_rows(params, (len(chain) + 1) * branches) > free:
            if chain:
                chain = chain[:-1]
            else:
                branches -= 1
        if not branches and params.draft_rows > free:
            return None
        stable = cache.length
        rows = [*guess, *chain]  # row (predicted feature of the previous row, token): the guess, then the chain
        known = self._flight_features(flight, tokens, stable, rows) if self.reuse_flight else None
        record: dict[tuple[int, ...], torch.Tensor] | None = {} if self.ahead_branches else None
        try:
            if known is not None:  # every row's predicted feature: one head step for all of them
                out = self.head(torch.stack([last, *known]), torch.tensor(rows, device=dev), cache)  # [j + m, H]
                last, lasts = out[len(guess) - 1], list(out[len(guess) - 1:])
            else:
                for tok in guess:
                    last = self.head(last[None], torch.tensor([tok], device=dev), cache)[0]
                lasts = [last]
                for tok in chain:
                    lasts.append(self.head(lasts[-1][None], torch.tensor([tok], device=dev), cache)[0])
            sort_paths = self._sort_paths[seq_id]
            if not branches:
                return rerank(expand(self.head, cache, last, params, record), guess[-1], params, sort_paths)
            return expand_branches(self.head, cache, torch.stack(lasts), guess[-1], list(chain), params, branches,
                                   tuple(exclude), sort_paths, record)
        finally:
            cache.truncate(stable)  # guessed rows came from draft features: never keep them
            if record:
                self._flight[seq_id] = (stable + len(guess), guess[-1], record)

    @staticmethod
    def _flight_features(flight: tuple[int, int, dict[tuple[int, ...], torch.Tensor]] | None, tokens: torch.Tensor,
                         length: int, rows: list[int]) -> list[torch.Tensor] | None:
        """The predicted features of rows[1:] (each the head output of the path before it) from the
        tree in flight's recorded expansion, or None: none recorded, fewer than two rows, or a path it
        does not hold. `length`: the draft KV's rows (its last row's token is the new root); `tokens`:
        this call's committed rows, which end with the path from the expansion's root to the new root
        (none: the same root)."""
        if flight is None or len(rows) < 2:
            return None
        root_at, root, record = flight
        n = int(tokens.shape[0])
        back = length - root_at  # committed tokens after the expansion's root
        if not 0 <= back <= n or back < n and int(tokens[n - back - 1]) != root:
            return None
        bridge = tuple(tokens[n - back:].tolist()) if back else ()
        known = [record.get((*bridge, *rows[:i])) for i in range(1, len(rows))]
        return None if any(h is None for h in known) else known  # type: ignore[return-value]

    @staticmethod
    def _realign(seq_id: str, cache: KVRows, first_row: int) -> None:
        """Drop the draft KV's rows from `first_row` on (DraftCall.first_row); DraftRowsMissing when it
        holds fewer. The call's rows then rebuild `_last` (a draft call has at least one)."""
        if first_row < 0:
            raise InvalidRequest(f"first_row must be >= 0; got {first_row}")
        if first_row > cache.length:
            raise DraftRowsMissing(f"draft KV of sequence {seq_id!r} {ROWS_MISSING}: it holds {cache.length} "
                                   f"rows, first_row is {first_row}")
        if first_row < cache.length:
            cache.truncate(first_row)

    def release(self, seq_id: str) -> None:
        self._caches.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self._flight.pop(seq_id, None)
        self._sort_paths.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        slot = self._slots.pop(seq_id, None)
        if slot is not None and self.pool is not None:
            self.pool.release(slot)

    def _cache(self, seq_id: str) -> KVRows:
        try:
            return self._caches[seq_id]
        except KeyError:
            raise SequenceNotFound(f"unknown sequence {seq_id!r} on this drafter") from None

    @property
    def num_sequences(self) -> int:
        return len(self._caches)
