"""Per-position teacher-forced agreement of a head directory on datagen shards.

    python -m services.train.evaluate --head DIR [DIR ...] --data SHARDS [--split all|heldout|train]

Prints one JSON line per head: {"head", "top1": [depth], "top4": [depth], "tokens"}; the heads see
the same tokens, in the serving setup (bf16 weights loaded as the target's dtype, full vocabulary
for EAGLE-1/2, d2t for EAGLE-3).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.train.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--head", nargs="+", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--split", choices=["all", "heldout", "train"], default="all")
    p.add_argument("--target", default=None)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--limit", type=int, default=0, help="first N samples (0 = all)")
    args = p.parse_args(argv)
    if os.environ.get("AERIE_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["AERIE_TORCH_THREADS"]))
    from services.model.head_checkpoint import load_head
    from services.model.loading import find_default_gguf, load_target
    from services.train.shards import list_shards, load_samples
    from services.train.trainer import evaluate

    target = load_target(args.target or find_default_gguf(), torch.float32).model
    cache: dict[str, list] = {}
    for d in args.head:
        head = load_head(d, target)
        kind = "eagle3" if head.feature_kind == "taps" else "eagle"
        if kind not in cache:
            cache[kind] = load_samples(list_shards(args.data), kind, args.split)
            if args.limit:
                cache[kind] = cache[kind][: args.limit]
        print(json.dumps({"head": d, **evaluate(head, cache[kind], args.depth)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
