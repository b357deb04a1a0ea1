"""A prefill longer than the RPC deadline (issue "Long prompts", item 1), on the default model under
`aerie up`: one greedy request with a `--long`-token prompt while AERIE_RPC_TIMEOUT_S is `--deadline-s`,
far less than the whole prefill takes. Reported: the time to the first token, the tokens, and the
coordinator's aerie_prefill_chunk_timeouts_total and aerie_failovers_total (from its metrics port).

    AERIE_TORCH_THREADS=1 .venv/bin/python scripts/measure_prefill_deadline.py --long 8000 --deadline-s 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.rpc.channel import open_channel  # noqa: E402
from services.rpc.stubs import coordinator as cpb  # noqa: E402
from services.rpc.stubs import coordinator_grpc  # noqa: E402
from up_process import start_up  # noqa: E402  (scripts/)


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=8000, help="tokens in the prompt")
    ap.add_argument("--deadline-s", type=float, default=20.0, help="AERIE_RPC_TIMEOUT_S of the coordinator")
    ap.add_argument("--chunk", type=int, default=512, help="AERIE_PREFILL_CHUNK of the verifier")
    ap.add_argument("--wait-s", type=float, default=900.0, help="give up on the first token after this")
    args = ap.parse_args()
    env = {**os.environ, "AERIE_LOG_LEVEL": "ERROR", "AERIE_RPC_TIMEOUT_S": str(args.deadline_s),
           "AERIE_PREFILL_CHUNK": str(args.chunk), "AERIE_MAX_PROMPT_TOKENS": str(max(8192, args.long))}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        lines: list[str] = []
        up = start_up(["--port", "0", "--state-file", str(state)], env, lines)
        try:
            procs = json.loads(state.read_text())["processes"]
            coord = next(p for p in procs if p["role"] == "coordinator")
            prompt = [random.Random(0).randrange(49152) for _ in range(args.long)]
            ch = open_channel(coord["address"], 4 * 1024 * 1024)
            t0 = time.monotonic()
            first, tokens, error = None, [], ""
            try:
                for msg in coordinator_grpc.CoordinatorStub(ch).Generate(
                        cpb.GenerateRequest(prompt_ids=prompt, max_new_tokens=4, ignore_eos=True), timeout=args.wait_s):
                    first = first or time.monotonic() - t0
                    tokens += msg.tokens
            except Exception as e:  # noqa: BLE001 - reported
                error = str(e)[:300]
            url = next(re.search(r"metrics (http://\S+/metrics)", line).group(1) for line in lines
                       if line.startswith("coordinator") and "metrics http://" in line)
            metrics = urllib.request.urlopen(url).read().decode()
        finally:
            up.terminate()
            up.wait(timeout=60)
    print(json.dumps({"prompt_tokens": args.long, "rpc_timeout_s": args.deadline_s, "prefill_chunk": args.chunk,
                      "first_token_s": round(first, 1) if first else None, "tokens": len(tokens), "error": error,
                      "prefill_chunk_timeouts": counter(metrics, "aerie_prefill_chunk_timeouts_total"),
                      "failovers": counter(metrics, "aerie_failovers_total")}, indent=1))


if __name__ == "__main__":
    main()
