"""The EAGLE-2 draft with static shapes, for one sequence over a paged draft KV: capturable in a CUDA
graph (services/engine/draft_graphs.py replays it; the CPU runs it eagerly in tests).

    last = extend_static(head, pool, key_rows [S], write_rows [W], stable [1], count [1],
                         features [W, F], tokens [W])                                   -> [H]
    cand = expand_static(head, pool, key_rows [S], stable [1], last [H], top_k, depth)   -> Candidates
    cand, last = draft_static(...)        # both: the extension, then the expansion from its last row
    cand, last = draft_batch(...)         # the same for B sequences: [B, ...] inputs and outputs
    tree = rerank_static(cand, root, params)  # StaticTree: rerank's tree on the device

`extend_batch` / `expand_batch` / `draft_batch` run B sequences in each head step (the head's weights
read once a level for all of them): their rows are concatenated for the GEMMs, each attends over
its own S key slots only (batched attention: `StaticKV` gives the keys as [nKV, B, S, hd]), and each
keeps its own top-k per level; the one-sequence functions are B = 1 of them.

`extend_static` is `tree.extend` for n <= W newly committed rows padded to a width W: one head step
whose padded rows write their K/V to the pool's trash page and see only their own key slot; the
mask, the positions and the pick of row n - 1 are computed on the device from `stable` and `count`.

`expand_static` is `tree.expand_many` for a fixed shape (no dynamic depth): K first-level children
of `last`, then `depth` head steps over the K frontier nodes, each keeping the global best K of their
K x K children; candidates in the reference's flat order (`rerank` then keeps the best N - 1 on the
host). What changes is only how the draft KV is addressed: level i writes its K rows at logical rows
stable + i*K .. stable + i*K + K - 1 (arena rows `key_rows[...]`, gathered on the device) and
attends over all S key slots with a mask built on the device from `stable`, so nothing depends on a
value read back to the host. The tree rows stay in the arena past the committed length and are
overwritten by the next extension (the eager path truncates them; the effect is the same).
Lengths are the caller's: these functions write arena rows and never touch a PagedCache.

`rerank_static` is `tree.rerank` on the device with a fixed node count N = 1 + min(size - 1, C): what
the verifier's forward needs (tokens, depths, ancestor mask), queued without reading anything back, so
the verify can be queued behind the draft before the host has seen the candidates. With dynamic depth
the stop's count stays on the device: the first 1 + m nodes are rerank's (m = the candidates at or
above the stop, at least one), the rest pad the tree (children of the root, never accepted: the
host's tree, which acceptance walks, has only the first 1 + m).
"""

from __future__ import annotations

import torch

from services.model.eagle_head import DraftHead
from services.model.paged_kv import PagedKVPool
from services.model.uniform import key_mask
from services.spec.tree import Candidates, StaticTree, TreeParams


class StaticKV:
    """What the head's attention asks of a cache (`write`), over device index tensors: new rows go
    to `write_rows` [T] of the pool's arena, attention reads `key_rows` [S] (one sequence), or
    [B, S] (B sequences, each row attending over its own sequence's keys: the attention gets them
    as [nKV, B, S, hd], services/model/layers.py)."""

    def __init__(self, pool: PagedKVPool, write_rows: torch.Tensor, key_rows: torch.Tensor) -> None:
        self.pool, self.write_rows, self.key_rows = pool, write_rows, key_rows
        self.length = -1  # no host-side length: the mask carries it

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new [nKV, T, hd] -> the layer's K and V at the key slots [nKV, S, hd] ([nKV, B, S, hd])."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        k.index_copy_(1, self.write_rows, k_new.to(k.dtype))
        v.index_copy_(1, self.write_rows, v_new.to(v.dtype))
        rows = self.key_rows.reshape(-1)
        keys, vals = k.index_select(1, rows), v.index_select(1, rows)
        if self.key_rows.dim() == 2:
            return keys.view(k.shape[0], *self.key_rows.shape, -1), vals.view(v.shape[0], *self.key_rows.shape, -1)
        return keys, vals


def _batch_kv(pool: PagedKVPool, write_rows: torch.Tensor, key_rows: torch.Tensor, mask: torch.Tensor
              ) -> tuple[StaticKV, torch.Tensor]:
    """The cache and mask of one head step over B sequences' rows: write_rows [B, T], key_rows [B, S],
    mask [B, T, S]; one sequence (B = 1): its own [S] keys and [T, S] mask, as `expand_static` ran
    before batches (the same attention path, bit for bit)."""
    if key_rows.shape[0] == 1:
        return StaticKV(pool, write_rows.reshape(-1), key_rows[0]), mask[0]
    return StaticKV(pool, write_rows.reshape(-1), key_rows), mask


@torch.no_grad()
def expand_batch(head: DraftHead, pool: PagedKVPool, key_rows: torch.Tensor, stable: torch.Tensor,
                 last: torch.Tensor, top_k: int, depth: int) -> Candidates:
    """`expand_static` for B sequences at once (one head step per level for all of them: the head's
    weights are read once a level, whatever B): key_rows [B, S], stable [B], last [B, H] -> Candidates
    of [B, C] scores and tokens, [B, P] parents (each row a sequence's, as `expand_static`'s). Each
    sequence's rows attend over its own S key slots (batched attention, no cross-sequence scores)."""
    k, (b, s) = top_k, key_rows.shape
    h = last.shape[-1]
    device = last.device
    cos_t, sin_t = head.rotary.tables(0, head.dtype, device)  # precomputed by the caller
    top = torch.topk(head.log_probs(last), k, dim=-1)  # [B, K]
    scores_list, tokens_list = [top.values], [head.to_target(top.indices)]
    parents_list = [torch.zeros(b, 1, dtype=torch.long, device=device)]
    sel = torch.arange(k, device=device).expand(b, k)  # the frontier: flat indices into its block
    scores = top.values  # [B, K] cumulative log-prob
    cur_ids = tokens_list[0]  # [B, K]
    cur_hidden = last[:, None].expand(b, k, h)  # [B, K, H]
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
    tree_mask = eye  # [B, K, rows of the levels so far + K]: ancestors and itself
    block_start, total = 0, k
    offsets = torch.arange(k, device=device)
    for i in range(depth):
        write_rows = key_rows.gather(1, stable[:, None] + i * k + offsets)  # [B, K]
        positions = (stable + i)[:, None].expand(b, k).reshape(b * k)
        # [B, K, S]: the committed rows, then the tree's
        kv, mask = _batch_kv(pool, write_rows, key_rows, key_mask(stable, tree_mask, s))
        out = head._layer(cur_hidden.reshape(b * k, h).to(head.dtype), head.embed_tokens(cur_ids.reshape(b * k)),
                          cos_t[positions], sin_t[positions], kv, mask)  # [B*K, H]
        lp = head.log_probs(out).view(b, k, -1)  # [B, K, Vd]
        parents_list.append(sel + 1 + block_start)  # 1 + flat index of each expanded node
        child = torch.topk(lp, k, dim=-1)  # [B, K, K]
        cu = child.values + scores[:, :, None]  # [B, K, K] cumulative log-prob
        best = torch.topk(cu.reshape(b, k * k), k, dim=-1)
        sel, scores = best.indices, best.values  # [B, K]
        rows = sel // k  # which expanded node each survivor hangs from
        cur_hidden = out.view(b, k, h).gather(1, rows[:, :, None].expand(b, k, h))
        cur_ids = head.to_target(child.indices.reshape(b, k * k).gather(1, sel))
        tokens_list.append(head.to_target(child.indices).reshape(b, k * k))
        scores_list.append(cu.reshape(b, k * k))
        tree_mask = torch.cat((tree_mask.gather(1, rows[:, :, None].expand(b, k, tree_mask.shape[2])), eye), dim=2)
        block_start, total = total, total + k * k
    return Candidates(scores=torch.cat(scores_list, dim=1), tokens=torch.cat(tokens_list, dim=1),
                      parents=torch.cat(parents_list, dim=1))


def expand_static(head: DraftHead, pool: PagedKVPool, key_rows: torch.Tensor, stable: torch.Tensor,
                  last: torch.Tensor, top_k: int, depth: int) -> Candidates:
    """key_rows [S] arena rows of the sequence's logical rows 0..S-1 (S >= stable + depth*top_k);
    stable [1] its committed draft rows; last [H] the head output of its last committed row."""
    return _first(expand_batch(head, pool, key_rows[None], stable, last[None], top_k, depth))


def _first(cand: Candidates) -> Candidates:
    """The first sequence's candidates of a batch's [B, ...] ones."""
    return Candidates(scores=cand.scores[0], tokens=cand.tokens[0], parents=cand.parents[0])


@torch.no_grad()
def extend_batch(head: DraftHead, pool: PagedKVPool, key_rows: torch.Tensor, write_rows: torch.Tensor,
                 stable: torch.Tensor, count: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor
                 ) -> torch.Tensor:
    """`extend_static` for B sequences at once: key_rows [B, S], write_rows [B, W], stable [B],
    count [B], features [B, W, F], tokens [B, W] -> each sequence's row count - 1 [B, H]; each row
    attends over its own sequence's slots only."""
    (b, w), s = tokens.shape, int(key_rows.shape[1])
    device = tokens.device
    j = torch.arange(w, device=device)
    real = j[None] < count[:, None]  # [B, W]
    positions = stable[:, None] + torch.where(real, j, 0)  # [B, W]; padded rows: a valid position
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    eye = torch.eye(w, dtype=torch.bool, device=device)
    tree = torch.where(real[:, :, None], causal, eye)  # [B, W, W]
    kv, mask = _batch_kv(pool, write_rows, key_rows, key_mask(stable, tree, s))  # mask [B, W, S]
    cos_t, sin_t = head.rotary.tables(0, head.dtype, device)  # precomputed by the caller
    flat = positions.reshape(b * w)
    out = head._layer(features.reshape(b * w, -1).to(head.dtype), head.embed_tokens(tokens.reshape(b * w)),
                      cos_t[flat], sin_t[flat], kv, mask)  # [B*W, H]
    h = out.shape[-1]
    return out.view(b, w, h).gather(1, (count - 1)[:, None, None].expand(b, 1, h))[:, 0]


def extend_static(head: DraftHead, pool: PagedKVPool, key_rows: torch.Tensor, write_rows: torch.Tensor,
                  stable: torch.Tensor, count: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor
                  ) -> torch.Tensor:
    """`tree.extend` with static shapes: the n = count <= W newly committed rows, padded to W.

    key_rows [S] arena rows of the sequence's logical rows 0..S-1 (S >= stable + W: every padded
    row has a key slot of its own); write_rows [W] the arena rows of logical rows stable..stable+n-1,
    then TRASH_ROW for the W - n padded rows; stable [1] the committed draft rows before them;
    count [1] n (>= 1); features [W, F] and tokens [W] (padded rows: anything finite, e.g. zeros).
    Returns the head output of row n - 1 [H], picked on the device.

    Real row j sits at position stable + j and sees the committed rows and the new rows 0..j (the
    causal triangle); padded row j sees only its own key slot stable + j (whose arena row it does not
    write: it reads a stale finite row; its output is dropped). Nothing is read back to the host, and
    the cache's length is the caller's to advance by n.
    Example: stable 7, count 2, W 4 -> positions [7, 8, 7, 7]; row 1 sees slots 0..8; rows 2, 3
    see slots 9 and 10 only."""
    return extend_batch(head, pool, key_rows[None], write_rows[None], stable, count, features[None], tokens[None])[0]


def draft_batch(head: DraftHead, pool: PagedKVPool, key_rows: torch.Tensor, write_rows: torch.Tensor,
                stable: torch.Tensor, count: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                top_k: int, depth: int) -> tuple[Candidates, torch.Tensor]:
    """`draft_static` for B sequences (`extend_batch`, then `expand_batch`) -> ([B, ...] candidates,
    last [B, H]). key_rows [B, S] with S >= stable + W + depth*top_k for each."""
    last = extend_batch(head, pool, key_rows, write_rows, stable, count, features, tokens)
    return expand_batch(head, pool, key_rows, stable + count, last, top_k, depth), last


def draft_static(head: DraftHead, pool: PagedKVPool, key_rows: torch.Tensor, write_rows: torch.Tensor,
                 stable: torch.Tensor, count: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                 top_k: int, depth: int) -> tuple[Candidates, torch.Tensor]:
    """`extend_static`, then `expand_static` from its last row over stable + count committed rows
    (summed on the device) -> (candidates, last [H]). key_rows [S] with S >= stable + W + depth*top_k."""
    cand, last = draft_batch(head, pool, key_rows[None], write_rows[None], stable, count, features[None],
                             tokens[None], top_k, depth)
    return _first(cand), last[0]


@torch.no_grad()
def rerank_static(cand: Candidates, root: int | torch.Tensor, params: TreeParams) -> StaticTree:
    """`rerank` on the candidates' device with static shapes -> a StaticTree of N = 1 + min(size - 1, C)
    nodes for C candidates (module doc: with dynamic depth, nodes past the stop's count pad the tree).
    No value is read back to the host (`root`, an int or a [1] device tensor, is put in on the device).
    Example (eagle.md, K=2, D=2, size 6, root 16): tokens [16, 18, 0, 24, 16, 24], parents
    [0, 0, 0, 1, 1, 2], depths [0, 1, 1, 2, 2, 2], mask rows 100000/110000/101000/110100/110010/101001
    (as `rerank`, whose root's parent is -1)."""
    scores, k = cand.scores, params.top_k
    c = int(scores.shape[0])
    m = min(params.size - 1, c)
    device = scores.device
    best = torch.sort(scores, descending=True, stable=True).indices[:m]  # [M] (rerank's choice, its tie rule)
    if params.stop_logprob > float("-inf"):  # dynamic depth: the first `kept` of them, the rest padding
        kept = (scores >= params.stop_logprob).sum().clamp(1, m)
        best = torch.where(torch.arange(m, device=device) < kept, best, c)  # c: after every real index
    idx = torch.sort(best).values  # [M] ascending flat indices (parents precede children), padding last
    real = idx < c
    at = idx.clamp(max=c - 1)
    parent_flat1 = cand.parents[at // k]  # 1 + flat index of the parent, 0 = the root
    parent_node = torch.searchsorted(idx, parent_flat1 - 1) + 1
    parent_node = torch.where((parent_flat1 == 0) | ~real, 0, parent_node)  # [M]; padding hangs from the root
    n = m + 1
    one = torch.ones(1, dtype=torch.bool, device=device)
    up = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parent_node])  # [N]: the root's is itself
    first = (root.reshape(1).long() if isinstance(root, torch.Tensor)
             else torch.empty(1, dtype=torch.long, device=device).fill_(root))
    tokens = torch.cat([first, cand.tokens[at]])
    mask = torch.eye(n, dtype=torch.bool, device=device)
    cur = up
    for _ in range(params.depth + 1):  # a node is at most depth + 1 levels below the root
        mask.scatter_(1, cur[:, None], True)
        cur = up[cur]
    return StaticTree(tokens, up, mask.sum(1) - 1, mask, torch.cat([one, real]))
