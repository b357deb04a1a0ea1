"""The step scheduler on the default model in one process (no gRPC, no drafter): what each step holds
and what it costs while a long prompt prefills next to a decoding sequence.

A verifier servicer as `aerie verifier` builds it (its cached cost curve) with --itl-target-ms T; a
sequence A decodes one token per Decode call in a loop (a plain round; a drafter's tree would add
rows) while B's prompt arrives as 512-row chunk calls, one after the other (as a coordinator sends
them). Reported per setting: the step budget, B's prefill time alone (no A) and beside A, the rows
of the steps while B prefilled, the longest step and A's gaps (p50, max) during B's prefill.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_step_slices.py --itl 0,200,500 --long 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.step_cost import shape  # noqa: E402
from services.engine.step_scheduler import Queued  # noqa: E402
from services.engine.verifier import DecodeCall, PrefillCall  # noqa: E402
from services.rpc.config import ServiceConfig  # noqa: E402
from services.spec.sampling import SamplingParams  # noqa: E402
from verifier_svc.config import VerifierConfig, itl_target  # noqa: E402
from verifier_svc.server import load_servicer  # noqa: E402
from verifier_svc.servicer import FirstChunk, NextChunk  # noqa: E402

CHUNK = 512


async def prefill(s, seq_id: str, prompt: torch.Tensor) -> float:
    """B's chunks, one call after the other; seconds until the last one answered."""
    t0 = time.monotonic()
    total = prompt.shape[0]
    for start in range(0, total, CHUNK):
        part = prompt[start:start + CHUNK]
        more = start + CHUNK < total
        if start == 0:
            await s._admit(FirstChunk(seq_id, part, SamplingParams(), total + 64, "none", more=more, offset=0))
        else:
            await s.batcher.call_async(NextChunk(seq_id, part, last=not more, offset=start))
    return time.monotonic() - t0


async def one_setting(itl_ms: float | str, long_len: int) -> dict:
    s = load_servicer(VerifierConfig(ServiceConfig(host="127.0.0.1"), itl_target_ms=itl_ms))
    steps: list[tuple[float, int, float]] = []  # (end time, rows, seconds) of each forward
    s.batcher._on_batch = lambda st: steps.append((time.monotonic(), st.rows, st.seconds))
    trace: list[list[float]] = []  # per step with a learned budget: rows, attended pairs, seconds, predicted
    if s.step_budget is not None:
        learn = s.step_budget.observe

        def observe(ran, seconds):
            rows, pairs = shape(ran)
            trace.append([rows, pairs, round(seconds, 4), round(s.step_budget.cost.predict(rows, pairs), 4)])
            learn(ran, seconds)

        s.step_budget.observe = observe
    g = torch.Generator().manual_seed(0)
    vocab = s.vocab_size
    try:
        alone = await prefill(s, "B-alone", torch.randint(0, vocab, (long_len,), generator=g))
        await s.batcher.exclusive_async(s._release, "B-alone")
        a = await s._admit(PrefillCall("A", torch.randint(0, vocab, (32,), generator=g), SamplingParams(), 8192,
                                       "none"))
        done, gaps, times = asyncio.Event(), [], []

        async def decode() -> None:
            token, r = a.first_token, 1
            while not done.is_set():
                token = (await s.batcher.call_async(DecodeCall("A", token, r, False))).token
                times.append(time.monotonic())
                r += 1

        task = asyncio.create_task(decode())
        while len(times) < 4:
            await asyncio.sleep(0.01)
        t0, first = time.monotonic(), len(steps)
        beside = await prefill(s, "B", torch.randint(0, vocab, (long_len,), generator=g))
        t1 = time.monotonic()
        done.set()
        await task
    finally:
        s.close()
    during = [x for x in steps[first:] if x[0] <= t1]
    gaps = [y - x for x, y in zip(times, times[1:]) if y > t0 and x < t1]
    fitted = s.step_budget.cost.coefficients if s.step_budget is not None else None
    return {"itl_target_ms": itl_ms, "step_rows": s.step_rows, "long_prompt_tokens": long_len,
            "load_average_1m": round(os.getloadavg()[0], 2),
            "target_s_at_end": (None if s.step_budget is None
                                else round(s.step_budget.target([Queued(1, False, "A", prefix=64)]), 3)),
            "fitted_step_cost": None if fitted is None else {"a_s": round(fitted[0], 4), "b_s_per_row": round(fitted[1], 6),
                                                             "c_s_per_pair": fitted[2]},
            "rows_per_step_p10_p90": [sorted(r for _, r, _ in during)[len(during) // 10],
                                      sorted(r for _, r, _ in during)[(9 * len(during)) // 10]],
            "b_prefill_alone_s": round(alone, 2), "b_prefill_beside_a_s": round(beside, 2),
            "ratio": round(beside / alone, 2), "steps_during": len(during),
            "rows_per_step_p50": statistics.median(r for _, r, _ in during),
            "longest_step_s": round(max(x[2] for x in during), 3),
            "a_gap_p50_s": round(statistics.median(gaps), 3), "a_gap_max_s": round(max(gaps), 3),
            "steps": trace}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--itl", default="0,200", help="ITL targets in ms to compare (0 = off; auto)")
    ap.add_argument("--long", type=int, default=4096, help="tokens in B's prompt")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if os.environ.get("AERIE_TORCH_THREADS"):  # as `aerie verifier` does (aerie_cli/flags.py): its cost curve
        torch.set_num_threads(int(os.environ["AERIE_TORCH_THREADS"]))
    rows = [asyncio.run(one_setting(itl_target(t), args.long)) for t in args.itl.split(",")]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"step_slices": rows}, indent=1))


if __name__ == "__main__":
    main()
