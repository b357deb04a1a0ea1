"""The ahead tree's shape: one fresh-sized subtree under each likely bonus (`expand_branches`).

A hit (services/spec/ahead.py) verifies the ahead tree rerooted at the real bonus. Grown like a
round's tree (`tree.expand` + `tree.rerank`: one beam of `top_k` over all of it, `size` nodes), the
bonus's subtree gets one level less than a fresh tree and only its share of the beam and of the
nodes. Here the ahead tree is grown one level deeper and with a beam per *branch* instead:

  * branches  the `branches` most likely children of the ahead root (the guess's last token), each
              a candidate bonus. Tokens in `exclude` are skipped: the children of the guessed node
              in the tree in flight, which the verifier tries before it draws a bonus, so the bonus
              is never one of them (greedy: it would have been accepted; sampling: a rejected
              candidate has no mass left in the residual the bonus is drawn from).
  * under each branch b, the expansion a fresh tree rooted at b would run: `depth` more levels,
    `top_k` children per expanded node and a beam of `top_k` per level (per branch, not shared),
    then the best `size - 1` of b's descendants (scores relative to b rank like absolute ones).

So a hit whose bonus is a branch reroots to a tree of the round's own size and depth: the subtree
is what a fresh draft from b would give if b's row had the head's predicted feature (the target's
is not back yet). The whole tree holds 1 + branches * size nodes; `trim` (services/spec/ahead.py)
cuts any tree used for a round back to the round's shape, so the verifier sees a normal tree.

Draft-KV rows: branches (level 1) + depth * branches * top_k, on top of the guessed rows
(`ahead_rows`). Worked example (top_k 2, depth 1, size 3, branches 1, root 7, exclude {5}):
root children 5 (-0.1, excluded), 8 (-0.5), 9 (-2) -> block 0 [8, 9], branch 8; 8's row expands
to children 3 (-0.5-0.2), 4 (-0.5-0.9) -> level 2 keeps both; tree 7 -> 8 -> {3, 4}.

Pure tensors and a head step per level; no I/O. The draft cache is left as it was found.
"""

from __future__ import annotations

import torch

from services.model.eagle_head import DraftHead
from services.model.kv_cache import KVRows
from services.spec.tree import Candidates, DraftTree, TreeParams, build_tree


def ahead_rows(params: TreeParams, branches: int) -> int:
    """Draft-KV rows `expand_branches` writes (and drops) for this shape: branches rows for level 1,
    then `depth` levels of `branches * top_k` frontier rows."""
    return branches + params.depth * branches * params.top_k


class _Branches:
    """The expansion state: the frontier is grouped by branch, each branch with its own beam."""

    def __init__(self, head: DraftHead, lp: torch.Tensor, last: torch.Tensor, params: TreeParams,
                 branches: int, exclude: set[int]) -> None:
        k = params.top_k
        self.k, self.params = k, params
        top = torch.topk(lp, min(int(lp.shape[0]), k + len(exclude)))
        toks = head.to_target(top.indices)
        ok = torch.tensor([int(t) not in exclude for t in toks.tolist()], dtype=torch.bool, device=lp.device)
        order = torch.cat([ok.nonzero().squeeze(1), (~ok).nonzero().squeeze(1)])[:k]  # allowed first
        vals, toks = top.values[order], toks[order]  # block 0: K children of the root
        self.nb = max(0, min(branches, int(ok.sum()), int(vals.shape[0])))
        if params.stop_logprob > float("-inf") and self.nb:
            self.nb = max(1, min(self.nb, int((vals[: self.nb] >= params.stop_logprob).sum())))
        self.scores_list, self.tokens_list = [vals], [toks]
        self.parents_list = [torch.zeros(1, dtype=torch.long, device=lp.device)]
        self.branch_of = [torch.tensor([b if b < self.nb else -1 for b in range(int(vals.shape[0]))],
                                       device=lp.device)]  # per block: the branch of each candidate
        self.base = vals[: self.nb].clone()  # [B] each branch's own score (fresh trees start at 0)
        self.sel = torch.arange(self.nb, device=lp.device)  # [F] frontier: flat indices into its block
        self.scores = vals[: self.nb]  # [F] cumulative log-prob
        self.branch = torch.arange(self.nb, device=lp.device)  # [F] the frontier's branches
        self.cur_ids = toks[: self.nb]
        self.cur_hidden = last[None].expand(self.nb, -1)  # [F, H]
        self.tree_mask = torch.eye(self.nb, dtype=torch.bool, device=lp.device)  # [F, tree rows + F]
        self.block_start, self.total = 0, int(vals.shape[0])

    @property
    def width(self) -> int:
        return int(self.sel.shape[0])

    def wants(self, i: int) -> bool:
        """Expand level i? The branches' level plus `depth` levels under them, while any node of
        the frontier is at or above the stop (relative to its branch, as in a fresh tree)."""
        p = self.params
        if i > p.depth or self.width == 0:
            return False
        rel = self.scores - self.base[self.branch]
        return not (p.stop_logprob > float("-inf") and rel.max().item() < p.stop_logprob)

    def grow(self, head: DraftHead, out: torch.Tensor, lp: torch.Tensor) -> None:
        """out [F, H] the head outputs of this level's frontier, lp [F, V_draft] their log-probs.
        Each branch keeps its own `top_k` best children (a fresh tree's beam)."""
        k, stop = self.k, self.params.stop_logprob
        self.parents_list.append(self.sel + 1 + self.block_start)
        child = torch.topk(lp, k, dim=-1)  # [F, K]
        cu = child.values + self.scores[:, None]  # [F, K]
        flat = cu.view(-1)
        cand_branch = self.branch.repeat_interleave(k)  # [F * K]
        sels, brs = [], []
        for b in range(self.nb):
            idx = (cand_branch == b).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            best = torch.topk(flat[idx], min(k, int(idx.numel())))
            n = int(best.values.shape[0])
            if stop > float("-inf"):
                n = max(1, int((best.values - self.base[b] >= stop).sum()))
            sels.append(idx[best.indices[:n]])
            brs.append(torch.full((n,), b, dtype=torch.long, device=lp.device))
        self.branch_of.append(cand_branch)
        self.sel, self.branch = torch.cat(sels), torch.cat(brs)
        self.scores = flat[self.sel]
        rows = self.sel // k  # which expanded node each survivor hangs from
        self.cur_hidden = out[rows]
        self.cur_ids = head.to_target(child.indices.view(-1)[self.sel])
        self.tokens_list.append(head.to_target(child.indices))
        self.scores_list.append(cu)
        self.tree_mask = torch.cat((self.tree_mask[rows], torch.eye(self.width, dtype=torch.bool,
                                                                    device=lp.device)), dim=1)
        self.block_start, self.total = self.total, self.total + int(cu.numel())

    def candidates(self) -> Candidates:
        return Candidates(scores=torch.cat([s.reshape(-1) for s in self.scores_list]),
                          tokens=torch.cat([t.reshape(-1) for t in self.tokens_list]),
                          parents=torch.cat(self.parents_list))


def expand_branches(head: DraftHead, cache: KVRows, last: torch.Tensor, root: int, params: TreeParams,
                    branches: int, exclude: set[int], sort_paths: bool) -> DraftTree:
    """The ahead tree rooted at `root` (the guess's last token; `last` [H] the head output of its
    row): per branch, a fresh tree's expansion and rerank (module doc). At most
    1 + branches * params.size nodes; the cache needs `ahead_rows(params, branches)` free rows."""
    state = _Branches(head, head.log_probs(last[None])[0], last, params, branches, exclude)
    stable = cache.length
    try:
        for i in range(params.depth + 1):
            if not state.wants(i):
                break
            positions = torch.full((state.width,), stable + i, dtype=torch.long, device=last.device)
            out = head.forward_batch(state.cur_hidden, state.cur_ids, [cache], positions, [state.tree_mask],
                                     [0, state.width])  # [F, H]
            state.grow(head, out, head.log_probs(out))
    finally:
        cache.truncate(stable)  # tree rows came from draft features: never keep them
    return _rerank_branches(state.candidates(), torch.cat(state.branch_of), state.base, root, params,
                            state.nb, sort_paths)


def _rerank_branches(cand: Candidates, branch_of: torch.Tensor, base: torch.Tensor, root: int,
                     params: TreeParams, nb: int, sort_paths: bool) -> DraftTree:
    """Keep each branch node and its best `size - 1` descendants (tree.rerank per branch: a stable
    sort, so the kept set is ancestor-closed); link parents by flat index as rerank does."""
    k = params.top_k
    device = cand.scores.device
    flat = torch.arange(int(cand.scores.shape[0]), device=device)
    keep = [torch.arange(nb, device=device)]  # the branch nodes (block 0's first nb)
    for b in range(nb):
        desc = flat[(branch_of == b) & (flat >= k)]  # b's descendants, ascending flat order
        m = params.size - 1
        if params.stop_logprob > float("-inf"):
            m = max(1, min(m, int((cand.scores[desc] - base[b] >= params.stop_logprob).sum())))
        order = torch.sort(cand.scores[desc], descending=True, stable=True).indices[:m]
        keep.append(desc[order])
    idx = torch.sort(torch.cat(keep)).values  # [M] ascending: parents precede children
    parent_flat1 = cand.parents[idx // k]  # [M] 1 + flat index of the parent, 0 = the root
    parent_node = torch.searchsorted(idx, parent_flat1 - 1) + 1
    parent_node[parent_flat1 == 0] = 0
    parents = torch.cat([torch.tensor([-1], device=device), parent_node])
    tokens = torch.cat([torch.tensor([root], device=device), cand.tokens[idx]])
    scores = torch.cat([torch.zeros(1, device=device), cand.scores[idx].float()])
    return build_tree(tokens, parents, scores, sort_paths)
