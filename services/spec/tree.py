"""EAGLE-2 dynamic draft tree: extend the draft's committed rows, expand, rerank (eagle.md section 2).

Vocabulary used across aerie:
  * root        node 0: the token the target sampled last (the previous round's bonus, or the
                prefill's first token). It is not in the target KV yet.
  * draft node  every other node: a token proposed by the draft head.
  * depth       of a node: its distance from the root (root 0); the target sees node i at position
                prefix + depth[i]. `DraftTree.max_depth` is the deepest node's (`RoundStats.tree_max_depth`
                for the tree a round verified).
  * TreeParams.depth  of a shape: the expansion steps (`--tree-depth`), NOT a node depth: a full
                tree of depth d has max_depth d + 1 (the first level comes from the root's own head
                output, then d steps each add one level).
  * path        a root-to-leaf list of node indices (the reference's `retrieve_indices` row).

Phases (same names as the reference where it has them):
  1. `extend`  appends the newly committed rows (token t+1 paired with target feature t) to the
               draft KV and returns the head output of the last row.
  2. `expand`  runs `depth` steps; each step feeds the `top_k` best nodes of the previous level
               (one position per level), takes `top_k` children per node and keeps the global best
               `top_k` by cumulative draft log-probability. Tree rows are appended to the draft KV
               and dropped afterwards: the draft KV keeps only committed rows.
  3. `rerank`  keeps the `size - 1` best of all K + D*K^2 candidates (expanded or not),
               in flat-index order so parents precede children, and builds mask, depths, paths.

Dynamic depth (the DDD/SVIP idea; `TreeParams.stop_logprob`, chosen by services/spec/budget.py):
a branch stops where its cumulative draft log-probability falls below `stop_logprob` (too unlikely to
be accepted to pay for its draft and verify cost): `expand` feeds the next head step only the
frontier nodes at or above it, stops before a level where none is left, and `rerank` drops
candidates below it (at least one draft node is kept). A pruned node's children score lower still,
so this gives the tree that expanding every branch and then dropping would give, with fewer rows
in each head step (under continuous batching the rows of all sequences share one step).

A retrieved chain (services/spec/sam.py) joins a tree with `merge_chain`: it shares the prefix
that the tree already has and hangs the rest from there, so siblings stay distinct.

With the same head weights in fp32 this gives the reference's nodes, order, masks and positions.
It does not talk to the target or decide acceptance (`verify.py`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import pairwise

import torch

from services.errors import InvalidRequest
from services.model.eagle_head import DraftHead
from services.model.kv_cache import KVRows
from services.model.transfer import to_device_queued


@dataclass(frozen=True, slots=True)
class TreeParams:
    top_k: int = 10  # children per expanded node and beam width per level
    depth: int = 5  # expansion steps (--tree-depth); a full tree's max_depth is `depth + 1` (0: one level)
    size: int = 60  # the tree size: nodes kept, root included (the reference's total_tokens; --tree-tokens)
    stop_logprob: float = float("-inf")  # dynamic depth: no level / node below this cumulative log-prob

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise InvalidRequest(f"top_k must be >= 1 (--tree-top-k); got {self.top_k}")
        if self.depth < 0:
            raise InvalidRequest(f"depth must be >= 0 (expansion steps, --tree-depth); got {self.depth}")
        if self.stop_logprob != self.stop_logprob or self.stop_logprob > 0:
            raise InvalidRequest(f"stop_logprob must be a log-probability (<= 0); got {self.stop_logprob}")
        if self.size < 2:
            raise InvalidRequest(f"size must be >= 2 (root + one draft; --tree-tokens); got {self.size}")
        if self.size - 1 > self.num_candidates:
            raise InvalidRequest(
                f"size={self.size} needs more than the {self.num_candidates} candidates "
                f"(top_k + depth * top_k^2) that top_k={self.top_k}, depth={self.depth} produce; lower "
                f"size (--tree-tokens) or raise top_k / depth (--tree-top-k / --tree-depth)")

    @property
    def num_candidates(self) -> int:
        return self.top_k + self.depth * self.top_k ** 2

    @property
    def shape(self) -> tuple[int, int, int]:
        """(top_k, depth, size): the shape without the dynamic-depth threshold, which the adaptive budget
        moves every round (a run of tree rounds keeps its first: services/engine/engine.py, "Tree runs")."""
        return self.top_k, self.depth, self.size

    @property
    def draft_rows(self) -> int:
        """Draft-KV rows a tree expansion needs on top of the committed rows."""
        return self.depth * self.top_k

    @staticmethod
    def from_flags(top_k: int | None, depth: int | None, size: int | None) -> TreeParams | None:
        """--tree-* flags -> a fixed shape, or None (auto budget) when none is given; a missing one
        takes the class default."""
        if top_k is None and depth is None and size is None:
            return None
        d = TreeParams()
        return TreeParams(d.top_k if top_k is None else top_k, d.depth if depth is None else depth,
                          d.size if size is None else size)

    def covers(self, other: TreeParams) -> bool:
        """True if a KV sized for this shape holds `other`'s expansion and tree."""
        return other.draft_rows <= self.draft_rows and other.size <= self.size


@dataclass(frozen=True, slots=True)
class Candidates:
    """Everything `expand` proposes, flattened in the reference's order: the K first-level children,
    then for each step the K children of each of that step's F expanded nodes (F = K without dynamic
    depth; with it, the frontier nodes at or above the stop)."""

    scores: torch.Tensor  # [K + sum F*K] cumulative draft log-probability
    tokens: torch.Tensor  # [K + sum F*K] target token ids
    parents: torch.Tensor  # [1 + sum F] per K-block: 1 + flat index of the parent (0 = the root)


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: torch.Tensor  # [N] int64 target ids; node 0 is the root; N = TreeParams.size
    parents: torch.Tensor  # [N] int64 parent node index; -1 for the root
    depths: torch.Tensor  # [N] int64; root 0 (the reference's tree_position_ids)
    mask: torch.Tensor  # [N, N] bool: mask[i, j] = node j is node i or an ancestor of it
    paths: torch.Tensor  # [P, max_depth + 1] int64 root-to-leaf node indices, right-padded with -1
    scores: torch.Tensor  # [N] fp32 cumulative draft log-probability; 0 for the root

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max().item())

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree with every tensor on `device` (itself when already there: no copy)."""
        if self.tokens.device == torch.device(device):
            return self
        return DraftTree(tokens=self.tokens.to(device), parents=self.parents.to(device),
                         depths=self.depths.to(device), mask=self.mask.to(device), paths=self.paths.to(device),
                         scores=self.scores.to(device))


@dataclass(frozen=True, slots=True)
class StaticTree:
    """A draft tree of a fixed node count N on the device (tree_static.rerank_static): `rerank`'s tree
    for its `real` nodes (the first 1 + m), padded past them (dynamic depth: children of the root,
    never accepted)."""

    tokens: torch.Tensor  # [N] int64; node 0 is the root
    parents: torch.Tensor  # [N] int64; the root's is 0 (itself)
    depths: torch.Tensor  # [N] int64
    mask: torch.Tensor  # [N, N] bool ancestors-or-self
    real: torch.Tensor  # [N] bool: a node of the host tree (the first 1 + m)


@dataclass(eq=False)
class TreeOnDevice:
    """A draft tree whose structure is still on the drafter's device: what the verifier's forward
    reads, so the verify can be queued behind the draft before the host has the candidates; `host()`
    is the same tree on the host (it waits for the candidates' copy and runs `rerank` there, once).
    The first `host().size` nodes are the host tree's, node for node; with dynamic depth the rest pad
    the tree and are never accepted. In one process only (one device: the in-process engine, a
    verifier that drafts too)."""

    static: StaticTree
    resolve: Callable[[], DraftTree]  # the host tree (called once, by `host`: any thread)
    _host: DraftTree | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def tokens(self) -> torch.Tensor:
        return self.static.tokens

    @property
    def depths(self) -> torch.Tensor:
        return self.static.depths

    @property
    def mask(self) -> torch.Tensor:
        return self.static.mask

    @property
    def size(self) -> int:
        """The rows the verifier's forward runs (>= the host tree's size)."""
        return int(self.static.tokens.shape[0])

    def host(self) -> DraftTree:
        with self._lock:
            if self._host is None:
                self._host = self.resolve()
        return self._host


def tree_on_device(tree: DraftTree, device: torch.device) -> TreeOnDevice:
    """A host tree as a TreeOnDevice on `device` (its structure copied there; `host()` is `tree`): for
    a round whose next draft is queued from its verdict (next_rows_on_device reads the structure)."""
    parents = tree.parents.clone()
    parents[0] = 0  # (the root's parent is itself on the device)
    static = StaticTree(tokens=to_device_queued(tree.tokens, device), parents=to_device_queued(parents, device),
                        depths=to_device_queued(tree.depths, device), mask=to_device_queued(tree.mask, device),
                        real=torch.ones(tree.size, dtype=torch.bool, device=device))
    return TreeOnDevice(static, lambda: tree, tree)


def host_tree(tree: DraftTree | TreeOnDevice) -> DraftTree:
    """The tree on the host (a TreeOnDevice's `host()`; a DraftTree is one already)."""
    return tree.host() if isinstance(tree, TreeOnDevice) else tree


def extend(head: DraftHead, cache: KVRows, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Append committed draft rows: row r pairs `tokens[r]` (token t+1) with `features[r]` (the
    target feature of token t). features [n, F], tokens [n] -> head output of the last row [H].
    WARNING: mutates `cache` (n more rows)."""
    out = head(features, tokens, cache)
    return out[-1]


def extend_many(head: DraftHead, caches: list[KVRows], features: list[torch.Tensor],
                tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """`extend` for many sequences in one head step: caches[i] takes features[i] [n_i, F] and
    tokens[i] [n_i] -> each sequence's last-row head output [H]."""
    if len(caches) == 1:
        return [extend(head, caches[0], features[0], tokens[0])]
    offsets = [0]
    for t in tokens:
        offsets.append(offsets[-1] + int(t.shape[0]))
    positions = torch.cat([torch.arange(c.length, c.length + int(t.shape[0]), device=t.device)
                           for c, t in zip(caches, tokens, strict=True)])
    out = head.forward_batch(torch.cat(features), torch.cat(tokens), caches, positions,
                             [None] * len(caches), offsets)
    return [out[b - 1] for b in offsets[1:]]


def expand(head: DraftHead, cache: KVRows, last: torch.Tensor, params: TreeParams,
           record: dict[tuple[int, ...], torch.Tensor] | None = None) -> Candidates:
    """Grow `params.depth` levels from `last` [H], the head output of the last committed row.
    The draft cache is left exactly as it was found. `record`: see `expand_many`."""
    return expand_many(head, [cache], [last], [params], None if record is None else [record])[0]


class _Beam:
    """One sequence's expansion state inside `expand_many`. The frontier is the `top_k` best nodes
    of the last level; with dynamic depth (`stop_logprob`) only those at or above the stop stay in it
    (per branch: a pruned node's children score lower still, so `rerank` would drop them anyway),
    and each level's candidates are K children per frontier node, in frontier order."""

    def __init__(self, head: DraftHead, cache: KVRows, last: torch.Tensor, lp: torch.Tensor,
                 params: TreeParams, record: dict[tuple[int, ...], torch.Tensor] | None = None) -> None:
        k = params.top_k
        device = last.device
        self.cache, self.params, self.k = cache, params, k
        self.stable = cache.length
        top = torch.topk(lp, k)
        self.scores_list, self.tokens_list = [top.values], [head.to_target(top.indices)]
        self.parents_list = [torch.zeros(1, dtype=torch.long, device=device)]
        self.sel = self._kept(top.values)  # [F] frontier: flat indices into the block it came from
        self.scores = top.values[: self.sel.shape[0]]  # [F] cumulative log-prob
        self.cur_ids = self.tokens_list[0][: self.sel.shape[0]]  # [F]
        self.cur_hidden = last[None].expand(self.sel.shape[0], -1)  # [F, H]
        self.tree_mask = self._eye(self.sel.shape[0])  # [F, tree rows so far + F]: ancestors and itself
        self.block_start, self.total = 0, k  # where the frontier's block starts; candidates so far
        self.done = False
        # `record`: token path from the root -> that node's head output [H] (the root's and every expanded
        # node's: Drafter.draft_ahead feeds them to a guess's rows instead of running them one by one)
        self.record = record
        if record is not None:
            record[()] = last
            self.paths = [(t,) for t in self.cur_ids.tolist()]  # the frontier's paths

    @property
    def width(self) -> int:
        return int(self.sel.shape[0])

    def _kept(self, ranked: torch.Tensor) -> torch.Tensor:
        """Positions of the frontier among `ranked` (descending): all of them, or with dynamic depth
        those at or above the stop (at least one: `wants` ends the beam when even that is below)."""
        n = int(ranked.shape[0])
        if self.params.stop_logprob > float("-inf"):
            n = max(1, int((ranked >= self.params.stop_logprob).sum()))
        return torch.arange(n, device=ranked.device)

    def _eye(self, n: int) -> torch.Tensor:
        return torch.eye(n, dtype=torch.bool, device=self.scores_list[0].device)

    def wants(self, i: int) -> bool:
        """Expand level i? (depth reached, or dynamic depth: even the best frontier node is too
        unlikely to pay)."""
        p = self.params
        if self.done or i >= p.depth or (p.stop_logprob > float("-inf") and self.scores.max().item() < p.stop_logprob):
            self.done = True
        return not self.done

    def grow(self, head: DraftHead, i: int, out: torch.Tensor, lp: torch.Tensor) -> None:
        """out [F, H] the head outputs of this level's frontier, lp [F, V_draft] their log-probs."""
        k = self.k
        if self.record is not None:
            for path, row in zip(self.paths, out, strict=True):
                self.record[path] = row
        self.parents_list.append(self.sel + 1 + self.block_start)  # 1 + flat index of each expanded node
        child = torch.topk(lp, k, dim=-1)  # [F, K]
        cu = child.values + self.scores[:, None]  # [F, K] cumulative log-prob
        best = torch.topk(cu.view(-1), k)
        keep = self._kept(best.values)
        self.sel, self.scores = best.indices[keep], best.values[keep]
        rows = self.sel // k  # which expanded node each survivor hangs from
        self.cur_hidden = out[rows]
        self.cur_ids = head.to_target(child.indices.view(-1)[self.sel])
        if self.record is not None:
            self.paths = [self.paths[r] + (t,) for r, t in zip(rows.tolist(), self.cur_ids.tolist(), strict=True)]
        self.tokens_list.append(head.to_target(child.indices))
        self.scores_list.append(cu)
        self.tree_mask = torch.cat((self.tree_mask[rows], self._eye(self.width)), dim=1)
        self.block_start, self.total = self.total, self.total + int(cu.numel())

    def candidates(self) -> Candidates:
        return Candidates(scores=torch.cat([s.reshape(-1) for s in self.scores_list]),
                          tokens=torch.cat([t.reshape(-1) for t in self.tokens_list]),
                          parents=torch.cat(self.parents_list))


def expand_many(head: DraftHead, caches: list[KVRows], lasts: list[torch.Tensor],
                params: list[TreeParams], records: list[dict] | None = None) -> list[Candidates]:
    """`expand` for many sequences: each level is ONE head step over the frontiers of every
    sequence still expanding (each with its own top_k, depth and stop, its own KV and tree mask),
    and one log-prob projection over all their rows. Each sequence's candidates are what `expand`
    alone gives it (fp32: up to the GEMM's rounding). The draft caches are left as they were found.
    `records[i]` (a dict, filled): token path from sequence i's root -> that node's head output [H],
    for the root (path ()) and every node the expansion ran through the head (a host read per level)."""
    lp0 = head.log_probs(torch.stack(lasts))  # [B, V_draft]
    each: list[dict | None] = list(records) if records is not None else [None] * len(caches)
    beams = [_Beam(head, c, last, lp, p, r) for c, last, lp, p, r in zip(caches, lasts, lp0, params, each, strict=True)]
    device = lasts[0].device
    try:
        for i in range(max(p.depth for p in params)):
            active = [b for b in beams if b.wants(i)]
            if not active:
                break
            offsets = [0]
            for b in active:
                offsets.append(offsets[-1] + b.width)
            positions = torch.cat([torch.full((b.width,), b.stable + i, dtype=torch.long, device=device)
                                   for b in active])
            out = head.forward_batch(torch.cat([b.cur_hidden for b in active]), torch.cat([b.cur_ids for b in active]),
                                     [b.cache for b in active], positions, [b.tree_mask for b in active],
                                     offsets)  # [R, H]
            lp = head.log_probs(out)  # [R, V_draft]
            for b, (lo, hi) in zip(active, pairwise(offsets), strict=True):
                b.grow(head, i, out[lo:hi], lp[lo:hi])
    finally:
        for b in beams:
            b.cache.truncate(b.stable)  # tree rows came from draft features: never keep them
    return [b.candidates() for b in beams]


def rerank(cand: Candidates, root: int, params: TreeParams, sort_paths: bool) -> DraftTree:
    """Keep the best `size - 1` candidates and build the tree around `root`.

    `sort_paths` (sampling) orders paths lexicographically by node index with -1 last, so siblings
    are tried in descending draft probability; greedy keeps leaf order.

    Worked example (eagle.md; K=2, D=2, size=6, root 16):
        tokens [16, 18, 0, 24, 16, 24], depths [0, 1, 1, 2, 2, 2],
        paths [[0,1,3],[0,1,4],[0,2,5]], mask rows 100000/110000/101000/110100/110010/101001."""
    k, m = params.top_k, params.size - 1
    device = cand.scores.device
    if params.stop_logprob > float("-inf"):  # dynamic depth: drop nodes unlikely to pay (keep one)
        m = max(1, min(m, int((cand.scores >= params.stop_logprob).sum())))
    m = min(m, int(cand.scores.shape[0]))
    # The best M by score. NOTE: the reference uses topk, whose choice among exactly tied scores
    # is unspecified: it can keep a child without its parent (e.g. a log-prob of exactly 0), and then
    # `searchsorted` links the child to the wrong node and a path can start at a non-root node
    # (eagle.md section 2). A stable sort breaks ties by flat index, and a parent's index is below
    # its children's, so the kept set is always ancestor-closed. Without ties the set is the same.
    best = torch.sort(cand.scores, descending=True, stable=True).indices[:m]
    idx = torch.sort(best).values  # [M] ascending flat indices: parents precede children
    parent_flat1 = cand.parents[idx // k]  # [M] 1 + flat index of the parent, 0 = root
    # parent position among the kept nodes (+1 for the root slot)
    parent_node = torch.searchsorted(idx, parent_flat1 - 1) + 1
    parent_node[parent_flat1 == 0] = 0
    parents = torch.cat([torch.tensor([-1], device=device), parent_node])  # [N]
    tokens = torch.cat([torch.tensor([root], device=device), cand.tokens[idx]])
    scores = torch.cat([torch.zeros(1, device=device), cand.scores[idx].float()])
    return build_tree(tokens, parents, scores, sort_paths)


def build_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, sort_paths: bool
               ) -> DraftTree:
    """tokens [N], parents [N] (-1 for the root; parents precede children), scores [N] -> the tree
    with its ancestor mask, depths and paths."""
    parent_list = parents.tolist()
    depths, mask = ancestors(parent_list, tokens.device)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=mask,
                     paths=_paths(parent_list, depths.tolist(), sort_paths, tokens.device), scores=scores)


def ancestors(parents: list[int], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """parents [N] (-1 for the root; parents precede children) -> (depths [N] long, mask [N, N] bool),
    mask[i, j] = j is i or an ancestor of i. One pass: a node's ancestors are its parent's plus itself
    (O(N x depth) list work, then one scatter onto `device`).
    Example: parents [-1, 0, 0, 1] -> depths [0, 1, 1, 2]; mask row 3 = [1, 1, 0, 1]."""
    n = len(parents)
    depth = [0] * n
    chains: list[list[int]] = [[0]] * n
    flat = [0]  # mask entries set, as row * n + column
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        chains[i] = chains[p] + [i]
        flat.extend(i * n + j for j in chains[i])
    mask = torch.zeros(n * n, dtype=torch.bool, device="cpu")  # built from Python lists: one copy to `device`
    mask[torch.tensor(flat, device="cpu")] = True
    return torch.tensor(depth, dtype=torch.long, device=device), mask.view(n, n).to(device)


def root_tree(root: int) -> DraftTree:
    """The tree of no draft at all: verifying it is one plain decode step that also returns the
    root's target feature (so the draft KV can catch up later). Its structure tensors are one shared
    (read-only) template: a detached round plans one of these per token."""
    return replace(_root_template(), tokens=torch.tensor([root], device="cpu"))


@functools.cache
def _root_template() -> DraftTree:
    return build_tree(torch.tensor([0]), torch.tensor([-1]), torch.zeros(1), False)


def merge_chain(tree: DraftTree, chain: list[int], sort_paths: bool) -> tuple[DraftTree, list[int]]:
    """Join a retrieved chain (the tokens proposed after the root) to `tree` as a branch from the
    root: the prefix the tree already holds is shared, the rest hangs from the last shared node as
    new nodes (appended, so parents still precede children; score 0 = a one-hot proposal).

    Example: tree root 7 with children [5, 9] and 5 -> 3; chain [5, 4, 8] -> nodes 7, 5, 9, 3, 4, 8
    with parents [-1, 0, 0, 1, 1, 4]. Returns the tree and the chain's node indices (depth 1 first)."""
    if not chain:
        return tree, []
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    pairs = enumerate(zip(parents, tokens, strict=True))
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in pairs if i}  # (parent, token) -> node
    node = 0
    nodes: list[int] = []
    new_tokens: list[int] = []  # the chain tokens the tree lacks, appended as new nodes
    new_parents: list[int] = []
    for j, tok in enumerate(chain):
        nxt = children.get((node, tok))
        if nxt is None:
            for k, t in enumerate(chain[j:]):
                new_parents.append(node if k == 0 else len(tokens) + len(new_tokens) - 1)
                new_tokens.append(t)
                nodes.append(len(tokens) + len(new_tokens) - 1)
            break
        node = nxt
        nodes.append(node)
    if not new_tokens:
        return tree, nodes  # the tree already holds the whole chain
    device = tree.tokens.device
    merged = build_tree(
        torch.cat([tree.tokens, torch.tensor(new_tokens, dtype=tree.tokens.dtype, device=device)]),
        torch.cat([tree.parents, torch.tensor(new_parents, dtype=tree.parents.dtype, device=device)]),
        torch.cat([tree.scores, torch.zeros(len(new_tokens), dtype=tree.scores.dtype, device=device)]),
        sort_paths)
    return merged, nodes


def _paths(parents: list[int], depths: list[int], sort_paths: bool, device: torch.device | str = "cpu"
           ) -> torch.Tensor:
    n = len(parents)
    inner = set(parents[1:])
    width = max(depths) + 1
    rows = []
    for leaf in range(n):
        if leaf in inner:
            continue
        row = [-1] * width
        node = leaf
        for d in range(depths[leaf], -1, -1):
            row[d] = node
            node = parents[node]
        rows.append(row)
    if sort_paths:
        rows.sort(key=lambda r: [x if x >= 0 else n + 5 for x in r])
    return torch.tensor(rows, dtype=torch.long, device=device)


def grow_tree(head: DraftHead, cache: KVRows, features: torch.Tensor, tokens: torch.Tensor,
              params: TreeParams, sort_paths: bool) -> DraftTree:
    """extend -> expand -> rerank. `tokens` [n] are the newly committed tokens shifted by one
    (the last is the new root), `features` [n, F] the target features of the rows before them.

    Prefill: tokens = prompt[1:] + [t0], features = the prompt's features.
    Round k: tokens = [a_1..a_m, bonus], features = features of [root, a_1..a_m]."""
    return grow_trees(head, [cache], [features], [tokens], [params], [sort_paths])[0]


def grow_trees(head: DraftHead, caches: list[KVRows], features: list[torch.Tensor],
               tokens: list[torch.Tensor], params: list[TreeParams], sort_paths: list[bool]
               ) -> list[DraftTree]:
    """`grow_tree` for many sequences at once: one head step extends every sequence's draft KV,
    then each expansion level is one head step over every sequence's frontier (`expand_many`);
    each sequence keeps its own shape, KV and path order."""
    lasts = extend_many(head, caches, features, tokens)
    cands = expand_many(head, caches, lasts, params)
    return [rerank(c, int(t[-1].item()), p, sp) for c, t, p, sp in zip(cands, tokens, params, sort_paths, strict=True)]
