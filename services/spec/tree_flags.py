"""SGLang's names for the tree flags, so users coming from SGLang find them:

    --speculative-eagle-topk N        = --tree-top-k N      (children per node, beam width)
    --speculative-num-draft-tokens N  = --tree-tokens N     (nodes verified, root included, as in SGLang)
    --speculative-num-steps N         = --tree-depth N-1    (SGLang counts draft levels: the first level
                                                             comes from the root; aerie counts the
                                                             expansion steps after it, so its deepest
                                                             node is at depth --tree-depth + 1)

The aliases write the same destinations as aerie's flags (the last one given wins).
"""

from __future__ import annotations

import argparse


def depth_from_num_steps(text: str) -> int:
    """SGLang's --speculative-num-steps (draft levels) -> aerie's tree depth (expansion steps)."""
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if steps < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (aerie's --tree-depth >= 1); got {steps}")
    return steps - 1


def add_tree_aliases(group) -> None:
    """Add the SGLang aliases next to --tree-top-k / --tree-depth / --tree-tokens (dests tree_top_k,
    tree_depth, tree_tokens), on an argparse parser or argument group."""
    group.add_argument("--speculative-eagle-topk", dest="tree_top_k", type=int, default=argparse.SUPPRESS,
                       help="SGLang's name for --tree-top-k (default: that flag's)")
    group.add_argument("--speculative-num-draft-tokens", dest="tree_tokens", type=int, default=argparse.SUPPRESS,
                       help="SGLang's name for --tree-tokens, root included (default: that flag's)")
    group.add_argument("--speculative-num-steps", dest="tree_depth", type=depth_from_num_steps,
                       default=argparse.SUPPRESS,
                       help="SGLang's draft levels: sets --tree-depth to this minus 1 (default: --tree-depth's + 1)")
