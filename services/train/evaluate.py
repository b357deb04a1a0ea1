"""Per-position teacher-forced agreement of a head directory on datagen shards.

    python -m services.train.evaluate --head DIR [DIR ...] --data SHARDS [--split all|heldout|train]
                                      [--categories SPEC_BENCH.jsonl]

Prints one JSON line per head: {"head", "top1": [depth], "top4": [depth], "tokens"}; the heads see
the same tokens, in the serving setup (bf16 weights loaded as the target's dtype, full vocabulary
for EAGLE-1/2, d2t for EAGLE-3). `--categories` adds "categories": {category: the same fields} for
shards generated from that prompt file (datagen --prompts; a sample's category is its first turn's).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from services.errors import InvalidRequest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.train.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--head", nargs="+", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--split", choices=["all", "heldout", "train"], default="all")
    p.add_argument("--target", default=None)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--limit", type=int, default=0, help="first N samples (0 = all)")
    p.add_argument("--categories", default=None,
                   help="the Spec-Bench-style JSONL the shards were generated from: also per category")
    args = p.parse_args(argv)
    if os.environ.get("AERIE_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["AERIE_TORCH_THREADS"]))
    from services.model.head_checkpoint import load_head
    from services.model.loading import find_default_gguf, load_target
    from services.train.shards import list_shards, load_samples, written_prompt_ids
    from services.train.trainer import evaluate_groups

    if args.categories and args.split != "all":
        raise InvalidRequest(f"--categories needs --split all; got {args.split!r}")
    paths = list_shards(args.data)
    groups = categories(args.categories, written_prompt_ids(paths)) if args.categories else {}
    target = load_target(args.target or find_default_gguf(), torch.float32).model
    cache: dict[str, list] = {}
    for d in args.head:
        head = load_head(d, target)
        kind = head.config.kind
        if kind not in cache:
            cache[kind] = load_samples(paths, kind, args.split)
            if args.limit:
                cache[kind] = cache[kind][: args.limit]
        samples = cache[kind]
        within = {c: [i for i in idx if i < len(samples)] for c, idx in groups.items()}
        whole, per = evaluate_groups(head, samples, within, args.depth)
        row = {"head": d, **whole, **({"categories": per} if groups else {})}
        print(json.dumps(row), flush=True)
    return 0


def categories(prompt_file: str, ids: list[str]) -> dict[str, list[int]]:
    """{category: indices into the samples} for samples whose prompt id is a row of `prompt_file`
    (its first turn, as datagen --prompts reads it); samples of other prompts are left out."""
    from services.train.data import read_jsonl
    from services.train.datagen import prompt_id

    of = {}
    for _, row in read_jsonl(prompt_file):
        turns = row.get("turns") or [None]
        if turns[0]:
            of[prompt_id(turns[0])] = str(row.get("category", "all"))
    out: dict[str, list[int]] = {}
    for i, pid in enumerate(ids):
        if pid in of:
            out.setdefault(of[pid], []).append(i)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    raise SystemExit(main())
