"""What growing a contiguous (CPU) KV slot costs: one sequence decoding `--new-tokens` tokens after a
`--prompt`-token prompt, its slot grown by `--kv-growth-rows` each time it is full (the verifier's
rule, services/engine/kv_growth.py), timed per reallocation + copy. The paged CUDA arena grows by
pages and copies nothing, so this is the CPU's cost only. No model: the KV tensors alone, shaped
like the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; fp32 = 46,080 bytes/row).

    python -m services.bench.kv_growth --kv-growth-rows 256
    growth 256: 15 grows, 1.03 s in all, longest 119 ms, final 4161 rows   (a loaded 2-core CPU: 1.0-2.2 s)
"""

from __future__ import annotations

import argparse
import time

import torch

from services.engine.kv_growth import first_rows, grow_to
from services.model.kv_cache import KVCache


def measure(growth: int, prompt: int = 50, new_tokens: int = 4096, tree: int = 60, layers: int = 30,
            kv_heads: int = 3, head_dim: int = 64, dtype: torch.dtype = torch.float32) -> tuple[int, float, float, int]:
    """(grows, seconds in all, longest grow in seconds, final rows) for one sequence decoding one row a step."""
    capacity = prompt + new_tokens + tree
    cache = KVCache(layers, kv_heads, head_dim, first_rows(prompt, capacity, growth), dtype)
    cache.length = prompt
    grows, total, longest = 0, 0.0, 0.0
    for _ in range(new_tokens):
        want = grow_to(cache.length, 1, cache.capacity, capacity, growth)
        if want > cache.capacity:
            t0 = time.perf_counter()
            cache.grow(want)
            dt = time.perf_counter() - t0
            grows, total, longest = grows + 1, total + dt, max(longest, dt)
        cache.length += 1
    return grows, total, longest, cache.capacity


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-growth-rows", type=int, default=256)
    p.add_argument("--prompt", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    grows, total, longest, rows = measure(args.kv_growth_rows, args.prompt, args.new_tokens)
    print(f"growth {args.kv_growth_rows}: {grows} grows, {total:.2f} s in all, longest {longest * 1e3:.0f} ms, "
          f"final {rows} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
