"""In-process decode throughput of continuous batching (no services): N threads run plain decoding
through one BatchedVerifier (services/engine/batched.py) on the default model; prints the decode
tok/s while all N sequences decode (prefills left out) and the largest batch seen.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_batching.py --levels 1,4,16 --tokens 24
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from services.engine.batched import BatchedVerifier
from services.engine.engine import Engine, GenerationRequest
from services.engine.local import build_local_engine
from services.engine.verifier import Verifier


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    e = build_local_engine(None, "none", "fp32").engine
    for n in [int(x) for x in args.levels.split(",")]:
        bv = BatchedVerifier(Verifier(e.verifier.target, "none"))
        eng = Engine(bv, None, e.max_context, e.vocab_size, e.eos_token_ids)
        times: dict[int, list[float]] = {}

        def run(i: int) -> None:
            prompt = torch.randint(0, 1000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(i))
            times[i] = [time.perf_counter() for _ in eng.generate(
                GenerationRequest(tuple(prompt.tolist()), args.tokens, ignore_eos=True))]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lo, hi = max(v[1] for v in times.values()), min(v[-1] for v in times.values())
        tokens = sum(sum(1 for t in v if lo < t <= hi) for v in times.values())
        print(f"N={n}: decode {tokens / (hi - lo):.1f} tok/s, largest batch {bv.batcher.largest_batch}", flush=True)
        bv.close()


if __name__ == "__main__":
    main()
