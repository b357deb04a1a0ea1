"""Drafting ahead: the next tree is grown from a guessed verdict while the current tree is verified.

Vocabulary (one word per concept, used across aerie):
  * guess       the tokens the drafter bets the verifier will commit this round, in order: a prefix
                of a root-to-leaf path of the tree in flight (its draft tokens, root excluded),
                optionally followed by a bet on the bonus. Default: the highest-scoring leaf's path
                cut at `depth` tokens (`top_guess`: the best child at every step).
  * ahead tree  the tree drafted from the guess: its root is the guess's last token; its draft KV
                rows for the guessed tokens use the head's own predicted features (the target's
                are not back yet). Those rows are dropped afterwards: the draft KV keeps only
                committed rows with target features. Its shape (services/spec/ahead_tree.py): the
                top path past the guess (the chain) with a fresh-sized subtree under the likely
                bonuses at the root and at every chain node, so a hit reroots to a round-sized
                tree; `trim` cuts whatever tree a round uses back to the round's shape.
  * hit         the committed tokens start with the guess AND the rest of them (accepted drafts
                past the guess and the bonus) is a path of the ahead tree from its root; the round
                then verifies the ahead tree rerooted at that path's end (`reroot`: the real bonus
                is its root, the nodes the verdict contradicts are dropped). Anything else is a miss:
                the ahead tree is thrown away and the next tree is drafted as without overlap.

Losslessness does not depend on any of this: the verifier checks every token it commits, whatever
tree it is given. The trees differ from the non-overlapped run (an ahead tree's nodes come from
predicted features), so acceptance may differ; greedy output is the target's greedy output.

Example: tree in flight root 7 -> 5 -> 3 (top path), guess [5]; the verifier commits [5, 3, 9]
(accepted 5, 3; bonus 9). The ahead tree is rooted at 5; if it holds 5 -> 3 -> 9, the next round
verifies its subtree rooted at that 9 (`follow` finds it, `reroot` cuts it out). Committed [8, 2]: a miss.

This module is pure (tensors and lists): no head, no cache, no I/O.
"""

from __future__ import annotations

import torch

from services.spec.tree import DraftTree, TreeParams, build_tree


def top_guess(tree: DraftTree, depth: int) -> list[int]:
    """The first `depth` draft tokens of the tree's most likely path (root excluded): from the root,
    the highest-scoring child at every step (a leaf's cumulative score favours shallow leaves, so the
    best leaf is not the best guess of a long verdict).
    Example: tokens [7, 5, 8, 3], parents [-1, 0, 0, 1], scores [0, -.1, -2, -.3], depth 1 -> [5]."""
    if depth < 1 or tree.size < 2:
        return []
    parents = tree.parents.tolist()
    scores = tree.scores.tolist()
    toks = tree.tokens.tolist()
    path: list[int] = []
    node = 0
    while len(path) < depth:
        children = [i for i in range(node + 1, len(toks)) if parents[i] == node]
        if not children:
            break
        node = max(children, key=lambda i: (scores[i], -i))  # ties: the earlier node
        path.append(toks[node])
    return path


def follow(tree: DraftTree, tokens: list[int]) -> int | None:
    """The node reached from the root by `tokens` (each a child of the previous node), or None.
    Example: root 7 -> {5 -> 3, 8}: follow [5, 3] -> node of 3; [] -> 0; [8, 1] -> None."""
    parents = tree.parents.tolist()
    toks = tree.tokens.tolist()
    node = 0
    for tok in tokens:
        nxt = next((i for i in range(1, len(toks)) if parents[i] == node and toks[i] == tok), None)
        if nxt is None:
            return None
        node = nxt
    return node


def reroot(tree: DraftTree, node: int, sort_paths: bool) -> DraftTree:
    """The subtree under `node` as a tree of its own: `node` becomes the root (score 0; the others'
    cumulative scores are taken relative to it), node order kept (parents still precede children).
    Example: tokens [7, 5, 8, 3, 4], parents [-1, 0, 0, 1, 1], node 1 -> tokens [5, 3, 4], parents [-1, 0, 0]."""
    parents = tree.parents.tolist()
    keep = [node]
    inside = {node}
    for i in range(node + 1, tree.size):
        if parents[i] in inside:
            inside.add(i)
            keep.append(i)
    new_index = {old: new for new, old in enumerate(keep)}
    new_parents = [-1] + [new_index[parents[i]] for i in keep[1:]]
    idx = torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)
    scores = tree.scores[idx] - tree.scores[node]
    return build_tree(tree.tokens[idx], torch.tensor(new_parents, dtype=torch.long, device=tree.tokens.device),
                      scores, sort_paths)


def trim(tree: DraftTree, params: TreeParams, sort_paths: bool) -> DraftTree:
    """`tree` cut back to the round's shape: nodes at most `depth + 1` levels deep, then the best
    `size - 1` by score (a stable sort: ties keep the earlier node, so parents stay), and with dynamic
    depth only those at or above `stop_logprob` (one at least). A tree that fits is returned as is.
    Example: tokens [7, 5, 8, 3], parents [-1, 0, 0, 1], scores [0, -.1, -2, -.3], size 3 -> [7, 5, 3]."""
    depths = tree.depths.tolist()
    scores = tree.scores.tolist()
    ok = [i for i in range(1, tree.size) if depths[i] <= params.depth + 1]  # ancestor-closed
    ranked = sorted(ok, key=lambda i: -scores[i])  # sorted() is stable: a parent precedes its children
    if params.stop_logprob > float("-inf"):
        ranked = [i for i in ranked if scores[i] >= params.stop_logprob] or ranked[:1]
    ranked = ranked[: params.size - 1]
    if len(ranked) == tree.size - 1:
        return tree
    keep = [0] + sorted(ranked)
    new_index = {old: new for new, old in enumerate(keep)}
    parents = tree.parents.tolist()
    dev = tree.tokens.device
    idx = torch.tensor(keep, dtype=torch.long, device=dev)
    new_parents = torch.tensor([-1] + [new_index[parents[i]] for i in keep[1:]], dtype=torch.long, device=dev)
    return build_tree(tree.tokens[idx], new_parents, tree.scores[idx], sort_paths)


def use_ahead(ahead: DraftTree, guess: list[int], committed: list[int], sort_paths: bool) -> DraftTree | None:
    """The next round's tree if the guess hit (see the module doc), else None. A hit whose subtree
    is the root alone drafts nothing: it counts as a miss (the drafter drafts as without overlap).
    committed: this round's tokens (accepted drafts + the bonus)."""
    if committed[: len(guess)] != guess:
        return None
    node = follow(ahead, committed[len(guess):])
    if node is None:
        return None
    tree = reroot(ahead, node, sort_paths) if node else ahead
    return tree if tree.size >= 2 else None


def prefix_hits(guess_path: list[int], committed: list[int]) -> list[bool]:
    """For each depth j = 1..len(guess_path): would a guess of `guess_path[:j]` have hit with the
    bonus among the ahead tree's root children, i.e. are the committed tokens `guess_path[:j]` plus
    at most one more token? (The policy learns this rate per depth from EVERY tree round, drafted
    ahead or not: it is the distribution of accept lengths along the top path, so the policy guesses
    the most likely one; a longer remainder is rarely on the ahead tree, see the module doc.)
    Example: path [5, 3, 2], committed [5, 3, 9] -> [False, True, False]."""
    out = []
    for j in range(1, len(guess_path) + 1):
        out.append(committed[:j] == guess_path[:j] and len(committed) <= j + 1)
    return out


def chain_past(tree: DraftTree, guess: list[int], path: list[int]
               ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """For a guess on the tree's top path `path`: (chain, exclude). chain: the path past the guess
    (the verdict may accept more of it before the bonus); exclude[p]: the tree's children of the
    guessed node (p = 0) and of the chain's p-th node, which the verifier tries before it draws a
    bonus there (never the bonus). Another guess (an injected guesser's): no chain, no exclusion.
    Example: tokens [7, 5, 8, 3, 4], parents [-1, 0, 0, 1, 1], path [5, 3], guess [5]
    -> ((3,), ((3, 4), ()))."""
    if not guess or guess != path[: len(guess)]:
        return (), ()
    parents, toks = tree.parents.tolist(), tree.tokens.tolist()
    exclude = []
    for j in range(len(guess), len(path) + 1):
        node = follow(tree, path[:j])
        exclude.append(tuple(toks[i] for i in range(1, len(toks)) if parents[i] == node))
    return tuple(path[len(guess):]), tuple(exclude)
