"""What direct feature transport (verifier -> drafter) could take off a round: the drafter's catch-up.

Each round the drafter extends its draft KV with the newly committed rows (the target's features of
the accepted path, relayed by the coordinator with the next Draft) before it grows the next tree. A
direct stream from the verifier would let that extension run before the Draft arrives, so the most
it can save per EAGLE round is the extension plus decoding the features; plain rounds do not involve
the drafter at all. This times the extension of 1, 2 and 4 rows and the expansion of a few tree shapes
with the default model's shipped head (or --draft), on one thread, after a 300-row prompt.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_draft_catchup.py --out bench/results/draft-catchup-smollm2-t1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--prefix", type=int, default=300, help="committed rows in the draft KV first")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from aerie_cli.flags import set_torch_threads
    from services.engine.local import build_local_engine
    from services.spec.tree import TreeParams, expand, extend_many

    set_torch_threads()
    local = build_local_engine(args.target, args.draft, "fp32", None)
    drafter = local.engine.drafter
    assert drafter is not None, "--draft names no head"
    head = drafter.head
    f = head.config.feature_size
    g = torch.Generator().manual_seed(0)
    drafter.start("s", args.prefix + 64, False)
    drafter.draft("s", torch.randint(0, 1000, (args.prefix,), generator=g), torch.randn(args.prefix, f, generator=g),
                  TreeParams(4, 3, 16))
    cache, last = drafter._caches["s"], drafter._last["s"]
    stable = cache.length

    def ms(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
            cache.truncate(stable)
        return round((time.perf_counter() - t0) / args.repeats * 1e3, 3)

    out: dict = {"extend_ms": {}, "expand_ms": {}}
    for n in (1, 2, 4):
        feats, toks = torch.randn(n, f, generator=g), torch.randint(0, 1000, (n,), generator=g)
        out["extend_ms"][n] = ms(lambda: extend_many(head, [cache], [feats], [toks]))
    for shape in (TreeParams(1, 1, 2), TreeParams(2, 1, 3), TreeParams(4, 3, 16)):
        out["expand_ms"][f"{shape.size}/{shape.depth}/{shape.top_k}"] = ms(lambda: expand(head, cache, last, shape))
    out["config"] = {"draft": args.draft, "prefix": args.prefix, "repeats": args.repeats,
                     "torch_threads": os.environ.get("AERIE_TORCH_THREADS", "default"), "load_average": os.getloadavg()}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
