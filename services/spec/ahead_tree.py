"""The ahead tree's shape: a fresh-sized subtree under each likely bonus (`expand_branches`).

A hit (services/spec/ahead.py) verifies the ahead tree rerooted at the real bonus. Grown like a
round's tree (`tree.expand` + `tree.rerank`: one beam of `top_k` over all of it, `size` nodes), the
bonus's subtree is a level or more shallower than a fresh tree and holds only its share of the beam
and of the nodes. Here the ahead tree is built around where the bonus can be:

  * chain         the tree in flight's top path past the guess (the engine sends it): the verdict
                  may accept more of it before the bonus, so the ahead tree holds the chain as a path
                  from its root (the guess's last token), each chain row fed with the head's own
                  predicted feature like a guessed row.
  * attach point  the root and every chain node: the bonus hangs from one of them.
  * branch        one of the `branches` most likely children of an attach point, each a candidate
                  bonus. Skipped: the chain's next token there (already in the tree) and
                  `exclude[p]`, the attach point's children in the tree in flight, which the
                  verifier tries before it draws a bonus there, so the bonus is never one of them
                  (greedy: it would have been accepted; sampling: a rejected candidate has no mass
                  left in the residual).
  * under each branch b, the expansion a fresh tree rooted at b runs: `depth` more levels, `top_k`
    children per expanded node, a beam of `top_k` per level (per branch, not shared), then the best
    `size - 1` of b's descendants (scores relative to b rank like absolute ones).

So a hit whose bonus is a branch reroots to a tree of the round's own size and depth: the tree a
fresh draft from b would grow if b's row had the head's predicted feature (the target's is not back
yet). All attach points expand together, one head step per level (rows of different attach points
see the chain rows up to their own; the tree mask covers the chain rows too). The whole tree holds
1 + m + B * size nodes (m chain nodes, B = (m + 1) * branches at most); `ahead.trim` cuts any tree
used for a round back to the round's shape, so the verifier sees a normal tree.

Worked example (top_k 2, depth 0, size 2, branches 1; root 7, chain [5], exclude ()):
attach 0 = 7: children 5 (chain: skipped), 8 -> branch 8; attach 1 = 5: children 3, 4 -> branch 3.
Level 0 expands 8 and 3 in one head step (8's row sees no chain row, 3's sees 5's): each keeps its
best child. Tree: 7 -> {5 -> 3 -> c3, 8 -> c8}: nodes [7, 5, 8, 3, c8, c3].

Pure tensors and one head step per level; no I/O. The tree rows are dropped from the cache again.
"""

from __future__ import annotations

import torch

from services.model.eagle_head import DraftHead
from services.model.kv_cache import KVRows
from services.spec.tree import DraftTree, TreeParams, build_tree


def ahead_rows(params: TreeParams, branches: int) -> int:
    """Tree rows `expand_branches` writes (and drops) for `branches` branches in all: one row per
    branch, then `depth` levels of `branches * top_k` frontier rows."""
    return branches + params.depth * branches * params.top_k


def _branches(head: DraftHead, lp: torch.Tensor, params: TreeParams, branches: int, skip: set[int]
              ) -> list[tuple[int, float]]:
    """(token, log-prob) of the best `branches` children not in `skip`; with dynamic depth only those
    at or above the stop (one at least). lp [V_draft]."""
    top = torch.topk(lp, min(int(lp.shape[0]), params.top_k + len(skip)))
    out: list[tuple[int, float]] = []
    for v, t in zip(top.values.tolist(), head.to_target(top.indices).tolist(), strict=True):
        if t in skip:
            continue
        if out and v < params.stop_logprob:
            break
        out.append((t, v))
        if len(out) == branches:
            break
    return out


def expand_branches(head: DraftHead, cache: KVRows, lasts: torch.Tensor, root: int, chain: list[int],
                    params: TreeParams, branches: int, exclude: tuple[tuple[int, ...], ...],
                    sort_paths: bool, record: dict[tuple[int, ...], torch.Tensor] | None = None) -> DraftTree:
    """The ahead tree rooted at `root` (module doc). The cache ends with the guess's rows and then
    one row per chain token; lasts [m + 1, H]: the head outputs of the guess's last row and of each
    chain row (attach points 0..m); exclude[p]: tokens that are no branch at attach point p (missing
    entries: none). Needs `ahead_rows(params, (m + 1) * branches)` free cache rows;
    they are dropped again. `record` (a dict, filled): token path from `root` -> that node's head
    output [H], for the root, the chain and every node expanded (tree.expand_many's records)."""
    k, m, stop = params.top_k, len(chain), params.stop_logprob
    dev = lasts.device
    start = cache.length  # the first tree row; attach point p's row is at start - m - 1 + p
    lp0 = head.log_probs(lasts)  # [m + 1, V_draft]
    b_tok, b_score, b_att = [], [], []
    for p in range(m + 1):
        skip = set(exclude[p]) if p < len(exclude) else set()
        for t, v in _branches(head, lp0[p], params, branches, skip | ({chain[p]} if p < m else set())):
            b_tok.append(t)
            b_score.append(v)
            b_att.append(p)
    nb = len(b_tok)
    base = torch.tensor(b_score, device=dev)  # [B] each branch's own score (a fresh tree starts at 0)
    # the frontier: head inputs, scores, branch, node id (branches 0..B-1, then candidates), attach point
    f_hidden = lasts[torch.tensor(b_att, dtype=torch.long, device=dev)] if nb else lasts[:0]
    f_ids = torch.tensor(b_tok, dtype=torch.long, device=dev)
    f_score, f_branch = base.clone(), torch.arange(nb, device=dev)
    f_node, f_att = torch.arange(nb, device=dev), torch.tensor(b_att, dtype=torch.long, device=dev)
    # [F, m + tree rows + F]: chain row c is visible to attach points p > c; then tree ancestors
    mask = torch.cat((torch.arange(m, device=dev)[None, :] < f_att[:, None],
                      torch.eye(nb, dtype=torch.bool, device=dev)), dim=1)
    if record is not None:
        for p in range(m + 1):
            record[tuple(chain[:p])] = lasts[p]
        f_path = [tuple(chain[:p]) + (t,) for t, p in zip(b_tok, b_att, strict=True)]
    tokens, scores, parents, branch_of = [], [], [], []  # per level [F * K]: the candidates
    next_id = nb
    try:
        for i in range(params.depth + 1):
            if f_ids.numel() == 0 or (stop > float("-inf") and (f_score - base[f_branch]).max().item() < stop):
                break
            out = head(f_hidden, f_ids, cache, start - m + f_att + i, mask)  # [F, H]
            if record is not None:
                for path, row in zip(f_path, out, strict=True):
                    record[path] = row
            child = torch.topk(head.log_probs(out), k, dim=-1)  # [F, K]
            cu = (child.values + f_score[:, None]).reshape(-1)  # [F * K] cumulative log-prob
            toks = head.to_target(child.indices).reshape(-1)
            cand_branch = f_branch.repeat_interleave(k)
            tokens.append(toks)
            scores.append(cu)
            parents.append(f_node.repeat_interleave(k))
            branch_of.append(cand_branch)
            sel = _beams(cu, cand_branch, base, nb, k, stop)
            rows = sel // k
            f_hidden, f_ids, f_score, f_branch = out[rows], toks[sel], cu[sel], cand_branch[sel]
            if record is not None:
                f_path = [f_path[r] + (t,) for r, t in zip(rows.tolist(), f_ids.tolist(), strict=True)]
            f_node, f_att = next_id + sel, f_att[rows]
            mask = torch.cat((mask[rows], torch.eye(int(sel.shape[0]), dtype=torch.bool, device=dev)), dim=1)
            next_id += int(cu.shape[0])
    finally:
        cache.truncate(start)  # tree rows came from draft features: never keep them
    return _assemble(root, chain, b_tok, b_score, b_att, tokens, scores, parents, branch_of, base, params, sort_paths)


def _beams(cu: torch.Tensor, cand_branch: torch.Tensor, base: torch.Tensor, nb: int, k: int, stop: float
           ) -> torch.Tensor:
    """The next frontier: each branch keeps its own `top_k` best candidates (a fresh tree's beam), in
    branch order. cu [F * K] cumulative scores, cand_branch [F * K] -> flat indices [F']. Without
    dynamic depth every branch has the same frontier width (1, then top_k): one batched topk."""
    n = int(cu.shape[0])
    if stop == float("-inf") and n % nb == 0:
        width = n // nb  # candidates per branch, contiguous (the frontier is grouped by branch)
        top = torch.topk(cu.view(nb, width), min(k, width), dim=1).indices  # [B, K]
        return (top + torch.arange(nb, device=cu.device)[:, None] * width).reshape(-1)
    sels = []
    for b in range(nb):
        idx = (cand_branch == b).nonzero().squeeze(1)
        if idx.numel():
            best = torch.topk(cu[idx], min(k, int(idx.numel())))
            keep = int(best.values.shape[0])
            if stop > float("-inf"):
                keep = max(1, int((best.values - base[b] >= stop).sum()))
            sels.append(idx[best.indices[:keep]])
    return torch.cat(sels)


def _assemble(root, chain, b_tok, b_score, b_att, tokens, scores, parents, branch_of, base, params,
              sort_paths) -> DraftTree:
    """Root, chain, branches, then each branch's best `size - 1` descendants (a stable sort by score
    over ascending ids: ancestor-closed, as tree.rerank), in id order (parents precede children)."""
    m, nb = len(chain), len(b_tok)
    dev = base.device
    if tokens:
        c_tok, c_score = torch.cat(tokens), torch.cat(scores)
        c_parent, c_branch = torch.cat(parents), torch.cat(branch_of)
    else:
        c_tok = c_score = c_parent = c_branch = torch.zeros(0, dtype=torch.long, device=dev)
    keep = []
    for b in range(nb):
        idx = (c_branch == b).nonzero().squeeze(1)  # ascending candidate order
        n = params.size - 1
        if params.stop_logprob > float("-inf"):
            n = max(1, min(n, int((c_score[idx] - base[b] >= params.stop_logprob).sum())))
        keep.append(idx[torch.sort(c_score[idx], descending=True, stable=True).indices[:n]])
    kept = torch.sort(torch.cat(keep)).values if keep else torch.zeros(0, dtype=torch.long, device=dev)
    # new indices: root 0, chain 1..m, branches m+1.., then the kept candidates (node id = nb + index)
    index = {nb + int(c): m + 1 + nb + j for j, c in enumerate(kept.tolist())}
    index.update({b: m + 1 + b for b in range(nb)})
    out_tok = [root, *chain, *b_tok] + c_tok[kept].tolist()
    out_par = [-1, *range(m)] + list(b_att) + [index[int(p)] for p in c_parent[kept].tolist()]
    out_score = [0.0] * (m + 1) + list(b_score) + c_score[kept].float().tolist()
    return build_tree(torch.tensor(out_tok, dtype=torch.long, device=dev),
                      torch.tensor(out_par, dtype=torch.long, device=dev),
                      torch.tensor(out_score, dtype=torch.float32, device=dev), sort_paths)
