"""verify(T) / decode(1) of the target forward on the default model, several variants in ONE process
(docs/design.md "Cheaper rounds").

    AERIE_TORCH_THREADS=1 python bench/forward_cost.py --variants hf,transposed,both [--old DIR] [--rounds 9]

Each variant is the default model loaded with that weight layout (`load_target(layout=...)`), and
with `@bf16` / `@int8` in that dtype (e.g. `both:2@int8`);
`--old DIR` adds a variant "old" built by a copy of an older checkout's `services/model`, imported as
the package `services_old` from DIR (how the "before" numbers were taken). After a 128-token prefill
the script times, round-robin over variants and sizes, one plain decode step (T=1, last-row logits)
and one verification of a T-node chain (tree mask, logits for every row) for T in 1,2,4,8,16,32; the
cache is truncated back after each call. Prints per variant the medians (ms) and ratios to its own
decode(1), and each variant's time relative to the first variant, per size (ratios of medians taken
in the same rounds). `--dtype int8` quantizes the new variants' linears (quant.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from services.model.loading import find_default_gguf, load_target

TS = (1, 2, 4, 8, 16, 32)


def load_variant(name: str, source: str, dtype: torch.dtype, old_dir: str | None, int8: bool):
    """`LAYOUT[@fp32|bf16|int8]` or `old`."""
    name, _, dt = name.partition("@")
    if dt:
        int8 = dt == "int8"
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    if name == "old":
        sys.path.insert(0, old_dir)
        from services_old.model.loading import load_target as old_load
        return old_load(source, dtype).model
    model = load_target(source, dtype, layout=name).model
    if int8:
        from services.model.quant import quantize_linears
        quantize_linears(model)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="hf,transposed")
    p.add_argument("--old", default=None)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--sizes", default=",".join(map(str, TS)))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("AERIE_TORCH_THREADS", "1")))
    sizes = [int(s) for s in args.sizes.split(",")]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    source = find_default_gguf()
    names = args.variants.split(",") + (["old"] if args.old else [])
    models = {n: load_variant(n, source, dtype, args.old, args.dtype == "int8") for n in names}
    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(0))
    caches = {}
    for n, m in models.items():
        caches[n] = m.new_cache(256)
        m(ids[:128], caches[n], logits_for="last")
    base = 128

    def call(n: str, t: int) -> None:
        m, c = models[n], caches[n]
        if t == 0:  # plain decode
            m(ids[base:base + 1], c, logits_for="last")
        else:
            m(ids[base:base + t], c, positions=base + torch.arange(t),
              tree_mask=torch.ones(t, t, dtype=torch.bool).tril())
        c.truncate(base)

    kinds = [0] + sizes
    times = {(n, t): [] for n in names for t in kinds}
    for n in names:
        for t in kinds:
            call(n, t)  # warm-up
    for _ in range(args.rounds):
        for t in kinds:
            for n in names:
                t0 = time.perf_counter()
                call(n, t)
                times[(n, t)].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {}
    for n in names:
        d = med[(n, 0)]
        row = {"decode_ms": d} | {f"verify{t}_ms": med[(n, t)] for t in sizes} | \
              {f"verify{t}/decode": med[(n, t)] / d for t in sizes} | \
              {f"vs_{names[0]}": {("decode" if t == 0 else f"T{t}"): med[(n, t)] / med[(names[0], t)] for t in kinds}}
        out[n] = row
        print(f"{n:>10}: decode(1) {d:6.1f} ms | " +
              " ".join(f"T{t} {med[(n, t)]:6.1f} ({med[(n, t)] / d:.2f}D)" for t in sizes))
    for n in names[1:]:
        print(f"{n:>10} / {names[0]}: " + " ".join(f"{k} {v:.2f}" for k, v in out[n][f"vs_{names[0]}"].items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"threads": torch.get_num_threads(), "dtype": args.dtype, "variants": out}, fh, indent=1)


if __name__ == "__main__":
    main()
