"""What one layer's attention costs per forward when a query block attends to a long prefix: why a
small prefill slice at a long offset is expensive on the CPU (docs/distributed.md "Steps").

The default model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64), one
torch thread, each backend of services/model/attention.py forced in turn (`sdpa` is the CPU's), a
causal mask over the prefix; milliseconds per call, median of `--repeats`. Multiply by the layers
(30) for a forward's attention.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_prefix_attention.py --prefix 1000,7500 --rows 1,16,64,512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", default="1000,7500", help="KV rows before the block (comma-separated)")
    ap.add_argument("--rows", default="1,16,64,512", help="query rows of the block (comma-separated)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("AERIE_TORCH_THREADS", "1")))
    from services.model.attention import BACKENDS, ENV, attend

    heads, kv_heads, hd = 9, 3, 64
    backends = [b for b in BACKENDS if b != "paged"]  # `attend` runs `grouped` for it (no row table)
    rows_out = []
    print(f"{'prefix':>7} {'rows':>5} " + " ".join(f"{b + ' ms':>12}" for b in backends))
    for s in (int(x) for x in args.prefix.split(",")):
        for t in (int(x) for x in args.rows.split(",")):
            q, k, v = torch.randn(heads, t, hd), torch.randn(kv_heads, s + t, hd), torch.randn(kv_heads, s + t, hd)
            mask = torch.ones(t, s + t, dtype=torch.bool).tril(s)
            ms = {}
            for backend in backends:
                os.environ[ENV] = backend
                attend(q, k, v, mask, False)  # warm-up
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    attend(q, k, v, mask, False)
                    times.append((time.perf_counter() - start) * 1e3)
                ms[backend] = statistics.median(times)
            os.environ.pop(ENV, None)
            rows_out.append({"prefix": s, "rows": t, "ms": ms, "load_average": os.getloadavg()[0]})
            print(f"{s:>7} {t:>5} " + " ".join(f"{ms[b]:>12.2f}" for b in backends))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
