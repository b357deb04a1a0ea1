"""Head-of-line blocking by a long prompt (issue 15, item 2), on a real model under `aerie up`.

For each `--chunks` setting (0 = the whole prompt in one forward; C = chunks of C tokens,
AERIE_PREFILL_CHUNK of the verifier; `C:T` also sets AERIE_ITL_TARGET_MS=T, the step scheduler's
inter-token latency target, which cuts the chunk to the rows that fit T; plain C = T 0, off), one `aerie up` with one verifier, one drafter and one
coordinator serves a running greedy stream (A); once A has streamed a few messages, a second
request (B) with a `--long`-token prompt is admitted. Reported per setting: A's inter-message gaps
before B arrived (p50) and while B's prompt was being prefilled (p50, max), and B's time to its
first token; with --alone also B's time to its first token with no A running (same `aerie up`, before A).

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_long_prefill.py --chunks 0,512 --out /tmp/hol.json
    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_long_prefill.py --chunks 512:0,512:200 --alone --long 8000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.rpc.channel import open_channel  # noqa: E402
from up_process import start_up  # noqa: E402  (bench/)
from verifier_svc.config import itl_target  # noqa: E402
from services.rpc.stubs import coordinator as cpb  # noqa: E402
from services.rpc.stubs import coordinator_grpc  # noqa: E402


def start(state: Path, chunk: int, itl_ms: float | str) -> subprocess.Popen:
    env = {**os.environ, "AERIE_LOG_LEVEL": "ERROR", "AERIE_PREFILL_CHUNK": str(chunk),
           "AERIE_ITL_TARGET_MS": str(itl_ms)}
    return start_up(["--port", "0", "--state-file", str(state)], env)


def generate(address: str, prompt: list[int], n: int, times: list[float], stop: threading.Event | None = None) -> None:
    """Stream one greedy request; append the arrival time of every message that carries tokens."""
    ch = open_channel(address, 4 * 1024 * 1024)
    try:
        call = coordinator_grpc.CoordinatorStub(ch).Generate(
            cpb.GenerateRequest(prompt_ids=prompt, max_new_tokens=n, ignore_eos=True), timeout=1800)
        for msg in call:
            if msg.tokens:
                times.append(time.monotonic())
            if stop is not None and stop.is_set():
                call.cancel()
                return
    except Exception as e:  # noqa: BLE001 - a cancelled stream ends here; anything else is reported
        if stop is None or not stop.is_set():
            raise SystemExit(f"stream failed: {e}")
    finally:
        ch.close()


def one_setting(chunk: int, itl_ms: float | str, long_len: int, vocab: int, alone: bool) -> dict:
    alone_ttft = None
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        up = start(state, chunk, itl_ms)
        try:
            coord = next(p["address"] for p in json.loads(state.read_text())["processes"] if p["role"] == "coordinator")
            if alone:
                solo: list[float] = []
                s0 = time.monotonic()
                generate(coord, [random.Random(1).randrange(vocab) for _ in range(long_len)], 1, solo)
                alone_ttft = round(solo[0] - s0, 2)
            rng = random.Random(0)
            a_times: list[float] = []
            stop = threading.Event()
            a = threading.Thread(target=generate, args=(coord, [rng.randrange(vocab) for _ in range(32)], 4000,
                                                        a_times, stop), daemon=True)
            a.start()
            while len(a_times) < 12:
                time.sleep(0.05)
            t0 = time.monotonic()
            b_times: list[float] = []
            generate(coord, [rng.randrange(vocab) for _ in range(long_len)], 1, b_times)
            t1 = b_times[0]
            time.sleep(3)  # a few more of A's messages after B's prefill
            stop.set()
            a.join(timeout=60)
        finally:
            up.terminate()
            up.wait(timeout=60)
    before = [y - x for x, y in zip(a_times, a_times[1:]) if y <= t0]
    during = [y - x for x, y in zip(a_times, a_times[1:]) if y > t0 and x < t1]
    return {"prefill_chunk": chunk, "itl_target_ms": itl_ms, "long_prompt_tokens": long_len,
            "load_average_1m": round(os.getloadavg()[0], 2),
            "b_alone_time_to_first_token_s": alone_ttft,
            "a_gap_before_p50_s": round(statistics.median(before), 3),
            "a_gaps_during_prefill": len(during),
            "a_gap_during_p50_s": round(statistics.median(during), 3) if during else None,
            "a_gap_during_max_s": round(max(during), 3) if during else None,
            "b_time_to_first_token_s": round(t1 - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="0,512",
                    help="prefill chunk sizes to compare (0 = off); CHUNK:ITL_MS also sets AERIE_ITL_TARGET_MS")
    ap.add_argument("--alone", action="store_true", help="also B's time to first token with nothing else running")
    ap.add_argument("--long", type=int, default=8000, help="tokens in the long prompt")
    ap.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn from [0, vocab)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for setting in args.chunks.split(","):
        chunk, _, itl = setting.partition(":")
        rows.append(one_setting(int(chunk), itl_target(itl or "0"), args.long, args.vocab, args.alone))
    print(f"{'chunk':>6} {'ITL ms':>7} {'A p50 before':>13} {'A p50 during':>13} {'A max during':>13} {'B TTFT':>8} "
          f"{'B alone':>8}")
    for r in rows:
        print(f"{r['prefill_chunk']:>6} {r['itl_target_ms']!s:>7} {r['a_gap_before_p50_s']:>12}s "
              f"{r['a_gap_during_p50_s']!s:>12}s {r['a_gap_during_max_s']!s:>12}s {r['b_time_to_first_token_s']:>7}s "
              f"{r['b_alone_time_to_first_token_s']!s:>7}s")
    if args.out:
        args.out.write_text(json.dumps({"long_prefill": rows}, indent=1))


if __name__ == "__main__":
    main()
