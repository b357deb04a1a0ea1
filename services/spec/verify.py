"""Tree verification: which draft nodes the target accepts, and the bonus token (eagle.md section 3).

Vocabulary:
  * accepted token   a draft node on the chosen path that the target also produces.
  * accepted         m, the number of accepted draft tokens (root excluded); a round commits the
                     root and the m accepted tokens to the target KV and emits m + 1 new tokens
                     (the m accepted ones and the bonus).
  * accept_length    m + 1: the tokens one round (one target forward) commits, accepted drafts and
                     the bonus; the EAGLE papers' acceptance length tau is its mean. 1 for a plain
                     step. (Before this release `VerifyResponse.accept_length` on the wire was m:
                     now `accepted`; see proto/aerie/v1/verifier.proto.)
  * bonus token      the target's own next token after the last accepted node: its argmax (greedy),
                     a draw from the residual when every child at the next level was rejected, or a
                     draw from the full processed distribution when the path ran out of children.

Greedy: the longest path whose every token equals the target argmax after its prefix.

Sampling: multi-candidate rejection sampling with one-hot proposals (q(x) = 1), as the reference:
at each level the children of the accepted prefix are tried in path order (lexicographic = descending
draft score among siblings), duplicates skipped; child x is accepted with probability p(x), else p(x)
is zeroed and p renormalised (the residual). P(emit y) = p(y) for every y, so the output law equals
the target's. The draft's probabilities only affect speed. Draws come from the round's generator.
NOTE: acceptance uses `u < p(x)` with u ~ U[0,1) in float64 (the reference has `<=`): a token the
processor filtered out (p = 0) can then never be accepted; the two differ with probability zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.spec.sampling import SamplingParams, sample, target_probs, uniform
from services.spec.tree import DraftTree, StaticTree


@dataclass(frozen=True, slots=True)
class Acceptance:
    path: int  # the chosen row of tree.paths
    accepted: int  # m: accepted draft tokens, root excluded
    nodes: torch.Tensor  # [m + 1] node indices: root, then the accepted nodes (on the host)
    tokens: torch.Tensor  # [m + 1] their token ids (on the host)
    bonus: int  # the target's next token after nodes[-1]

    @property
    def new_tokens(self) -> list[int]:
        """The m + 1 tokens this round emits: the accepted draft tokens and the bonus."""
        return self.tokens[1:].tolist() + [self.bonus]


def _path_tokens(tree: DraftTree) -> torch.Tensor:
    """[P, W] token ids along each path, -1 where the path is padded."""
    padded = torch.cat([tree.tokens, torch.tensor([-1], device=tree.tokens.device)])
    return padded[tree.paths]  # index -1 picks the appended -1


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """logits [N, V]: the target's logits at every tree node, on any device."""
    return accept_greedy_argmax(tree, torch.argmax(logits, dim=-1))


def accept_greedy_argmax(tree: DraftTree, argmax: torch.Tensor) -> Acceptance:
    """argmax [N]: the target's argmax at every tree node (a batch computes it once for the rows of
    all its trees, then splits it); equal to argmax(logits[paths]) and much cheaper. The argmax comes
    to the host in ONE copy (N ints) and the walk runs there, in numpy, on the tree's host lists (a
    tree the drafter built on the host moves nowhere; a few hundred array entries cost less on the
    host than the device's kernel launches and the tree's copies to it): the first longest path
    whose every token equals the argmax after its prefix."""
    am = np.asarray(argmax.tolist(), dtype=np.int64)  # the one sync: the target's argmax at every node
    paths = tree.paths.cpu().numpy()  # [P, W], -1 padded (the host tree's own arrays: no copy)
    tokens = np.append(tree.tokens.cpu().numpy(), -1)  # index -1 reads the appended -1
    cand = tokens[paths]  # [P, W]
    pred = am[paths]  # pads read the last node, never compared with a real token (cand is -1 there)
    per_path = np.cumprod(cand[:, 1:] == pred[:, :-1], axis=1).sum(axis=1)  # [P]
    best = int(np.argmax(per_path))  # the first longest path (path 0 when nothing is accepted)
    m = int(per_path[best])
    nodes = paths[best, :m + 1]
    return Acceptance(path=best, accepted=m, nodes=torch.from_numpy(nodes.copy()),
                      tokens=torch.from_numpy(cand[best, :m + 1].copy()), bonus=int(am[nodes[-1]]))


@dataclass(frozen=True, slots=True)
class NextRows:
    """A greedy verdict still on the device, as the rows it commits: what the next draft extends by."""

    tokens: torch.Tensor  # [W] the m accepted draft tokens, then the bonus, then 0 (padding)
    nodes: torch.Tensor  # [W] the tree node whose feature each row takes: the root, the accepted nodes, then repeats
    count: torch.Tensor  # [1] m + 1: the real rows


def next_rows_on_device(tree: StaticTree, argmax: torch.Tensor, width: int) -> NextRows:
    """Greedy acceptance on the device, nothing read back: `accept_greedy_argmax`'s path as the rows the
    round commits (argmax [N] the target's at every node; `width` W >= the longest accept, max depth + 1).
    A node is consistent when it and each of its ancestors below the root carries the argmax of its
    parent; sibling tokens are distinct (the top-k of one distribution), so the consistent nodes form one
    chain from the root, whose deepest node ends the path the host walk accepts.
    Example: tokens [7, 5, 9, 3], parents [0, 0, 0, 1], argmax [5, 3, 1, 8], W 4 -> the path 0, 1, 3:
    tokens [5, 3, 8, 0], nodes [0, 1, 3, 3], count [3]."""
    n = int(tree.tokens.shape[0])
    device = argmax.device
    ar = torch.arange(n, device=device)
    ok = (tree.tokens == argmax[tree.parents]) | (ar == 0)
    consistent = tree.real & ~(tree.mask & ~ok[None, :]).any(1)
    # [1] the last accepted node (1-dim indices throughout: indexing with a 0-dim tensor reads it back)
    deepest = torch.where(consistent, tree.depths, -1).argmax().view(1)
    m = tree.depths.index_select(0, deepest)  # [1]
    order = torch.sort(torch.where(tree.mask.index_select(0, deepest)[0], ar, n)).values  # [N] the path, then n
    if n < width + 1:
        order = torch.cat([order, torch.full((width + 1 - n,), n, dtype=order.dtype, device=device)])
    order = order[:width + 1].clamp(max=n - 1)
    j = torch.arange(width, device=device)
    tokens = torch.where(j < m, tree.tokens[order[1:]], torch.where(j == m, argmax.index_select(0, deepest), 0))
    return NextRows(tokens, order[:width], m + 1)


def accept_sampling(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> Acceptance:
    """logits [N, V]; tree.paths sorted lexicographically (rerank(sort_paths=True)); `generator` on
    the logits' device. The draws run there; each tried candidate reads p(x) back (a host sync per
    draw, as the reference's loop)."""
    if generator.device != logits.device:
        raise ValueError(f"the generator is on {generator.device}, the logits on {logits.device}: "
                         f"create it with round_generator(..., device=logits.device)")
    tree = tree.to(logits.device)
    cand = _path_tokens(tree).tolist()  # [P][W]
    paths = tree.paths.tolist()
    width = len(cand[0])
    accepted = [cand[0][0]]  # the root
    best = 0
    p = None
    adjusted = False
    for level in range(1, width):
        if level != len(accepted):
            break  # the previous level accepted nothing
        adjusted = False
        rows = [j for j, row in enumerate(cand) if row[:level] == accepted]
        p = target_probs(logits[paths[rows[0]][level - 1]], params)  # [V] after the prefix
        seen: set[int] = set()
        for j in rows:
            x = cand[j][level]
            if x == -1 or x in seen:
                continue
            seen.add(x)
            if uniform(generator) < float(p[x]):
                accepted.append(x)
                best = j
                break
            p = p.clone()
            p[x] = 0
            p = p / p.sum()
            adjusted = True
    m = len(accepted) - 1
    nodes = paths[best][: m + 1]
    if not (adjusted and len(accepted) != width):
        p = target_probs(logits[nodes[-1]], params)
    assert p is not None  # adjusted: the loop set it
    return Acceptance(path=best, accepted=m, nodes=torch.tensor(nodes, dtype=torch.long, device="cpu"),
                      tokens=torch.tensor(accepted, dtype=torch.long, device="cpu"), bonus=sample(p, generator))


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> Acceptance:
    if params.greedy:
        return accept_greedy(tree, logits)
    assert generator is not None, "sampling needs the round's generator"
    return accept_sampling(tree, logits, params, generator)
