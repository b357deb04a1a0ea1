"""Measure fail-over on a real model (default: SmolLM2-135M with its shipped head) under `aerie up`:
(1) per fault kind, with 4 greedy streams, the time from the fault to the next committed token each
client receives (kill -9 of a drafter, a verifier, a coordinator + client Resume, Redis, then a
SIGTERM drain of the coordinator the streams run on: after AERIE_DRAIN_S it hands them over and the
clients Resume on the other one; for the drain also the gap between a stream's last token before the
hand-over and its first token after Resume), and whether every stream still equals its undisturbed
run; (2) the rebuild cost (verifier re-prefill + drafter refill, in process) against the sequence
length.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_failover.py --out /tmp/failover.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from up_process import start_up  # noqa: E402  (bench/)
from services.rpc.channel import open_channel  # noqa: E402
from services.rpc.stubs import coordinator as cpb  # noqa: E402
from services.rpc.stubs import coordinator_grpc  # noqa: E402

TREE = ["--tree-top-k", "8", "--tree-depth", "4", "--tree-tokens", "24"]
FAULTS = ("drafter", "verifier", "coordinator", "redis", "drain")  # drain: SIGTERM of a coordinator
DRAIN_S = 2.0  # AERIE_DRAIN_S of the coordinators: sequences still running after it are handed over


def start(state: Path, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "AERIE_LOG_LEVEL": "ERROR", "AERIE_PROBE_INTERVAL_S": "1", "AERIE_LEASE_TTL_S": "3",
           "AERIE_HEARTBEAT_S": "1", "AERIE_HEARTBEAT_TTL_S": "3", "AERIE_DRAIN_S": str(DRAIN_S)}
    return start_up(["--port", "0", "--verifiers", "2", "--drafters", "2", "--coordinators", "2",
                     "--state-file", str(state), *TREE, *extra], env)


def procs(state: Path, role: str) -> list[dict]:
    return [p for p in json.loads(state.read_text())["processes"] if p["role"] == role]


def stream(coordinators: list[str], prompt: list[int], n: int, out: dict) -> None:
    out.update(tokens=[], times=[], seq="", resumes=0, handovers=[])
    handed_at = None  # when a draining coordinator ended this stream (the hand-over)
    attempt = 0
    while attempt < 20:
        ch = open_channel(coordinators[attempt % len(coordinators)], 4 * 1024 * 1024)
        stub = coordinator_grpc.CoordinatorStub(ch)
        try:
            call = (stub.Generate(cpb.GenerateRequest(prompt_ids=prompt, max_new_tokens=n, ignore_eos=True), timeout=900)
                    if not out["seq"] else
                    stub.Resume(cpb.ResumeRequest(sequence_id=out["seq"], from_token_index=len(out["tokens"])),
                                timeout=900))
            for msg in call:
                out["seq"] = msg.sequence_id or out["seq"]
                out["tokens"] += msg.tokens
                now = time.monotonic()
                out["times"] += [now] * len(msg.tokens)
                if handed_at is not None and msg.tokens:
                    # last token before the hand-over -> first token after Resume on the other coordinator
                    out["handovers"].append({"last_token_to_end_s": round(handed_at[0] - handed_at[1], 3),
                                             "end_to_next_token_s": round(now - handed_at[0], 3),
                                             "named_index_ok": handed_at[2]})
                    handed_at = None
                if msg.finish_reason:
                    return
        except grpc.RpcError as e:
            if "coordinator draining" in (e.details() or "") and out["times"]:
                named = dict(e.trailing_metadata() or ()).get("aerie-resume-from")
                handed_at = (time.monotonic(), out["times"][-1], named == str(len(out["tokens"])))
            if not out["seq"] or e.code() != grpc.StatusCode.UNAVAILABLE:
                out["error"] = f"{e.code()}: {e.details()}"
                return
            attempt += 1
            out["resumes"] += 1
            time.sleep(0.2)
        finally:
            ch.close()


def run_streams(coordinators, prompts, n):
    results = [dict() for _ in prompts]
    threads = [threading.Thread(target=stream, args=(coordinators, p, n, r), daemon=True)
               for p, r in zip(prompts, results)]
    for t in threads:
        t.start()
    return threads, results


def faults(args) -> dict:
    state = Path(args.workdir) / "state.json"
    up = start(state, args.up_args)
    report: dict = {"faults": {}}
    try:
        coordinators = [p["address"] for p in procs(state, "coordinator")]
        prompts = [[(97 * i + 31 * k) % 40000 + 200 for k in range(48)] for i in range(args.streams)]
        threads, undisturbed = run_streams(coordinators, prompts, args.new_tokens)
        for t in threads:
            t.join()
        threads, results = run_streams(coordinators, prompts, args.new_tokens)
        kills = {}
        for role in FAULTS:
            time.sleep(args.gap_s)
            if not any(t.is_alive() for t in threads):
                report["faults"][role] = "streams ended before this fault"
                continue
            # the drain hits the coordinator the streams moved to after the first coordinator's kill
            victim = procs(state, "coordinator")[1] if role == "drain" else procs(state, role)[0]
            kills[role] = time.monotonic()
            os.kill(victim["pid"], signal.SIGTERM if role == "drain" else signal.SIGKILL)
        for t in threads:
            t.join()
        for role, t_kill in kills.items():
            # per stream: the wait from the kill to its next committed token, and the message interval
            # that contains the kill against the median interval (the added latency)
            waits, added = [], []
            for r in results:
                times = sorted(set(r["times"]))
                after = [t for t in times if t > t_kill]
                before = [t for t in times if t <= t_kill]
                if after:
                    waits.append(round(after[0] - t_kill, 3))
                if after and before:
                    added.append(after[0] - before[-1])
            report["faults"][role] = {"kill_to_next_token_s": waits,
                                      "interval_containing_kill_s": [round(a, 3) for a in added]}
        intervals = [b - a for r in results for a, b in zip(r["times"], r["times"][1:]) if b > a]
        report["median_round_interval_s"] = round(statistics.median(intervals), 3)
        report["streams_equal_undisturbed"] = [r.get("tokens") == u.get("tokens") for r, u in zip(results, undisturbed)]
        report["errors"] = [r.get("error") for r in results if r.get("error")]
        report["resumes"] = sum(r["resumes"] for r in results)
        report["drain_s"] = DRAIN_S
        report["drain_handovers"] = [h for r in results for h in r["handovers"]]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    return report


def rebuild_cost(lengths: list[int], repeats: int) -> dict:
    """Verifier re-prefill + drafter refill of L committed rows, in process (the RPC adds the feature
    transfer: L x hidden x 4 bytes)."""
    import torch

    from services.engine.local import build_local_engine
    from services.spec.sampling import SamplingParams
    local = build_local_engine(None, "auto", "fp32", None)
    engine = local.engine
    out = {}
    for n in lengths:
        times = []
        for r in range(repeats):
            prompt = torch.tensor([(31 * k) % 40000 + 200 for k in range(n)])
            c0, t0 = time.thread_time(), time.perf_counter()
            pre = engine.verifier.prefill(f"r{n}-{r}", prompt, SamplingParams(), n + 100)
            c1, t1 = time.thread_time(), time.perf_counter()
            engine.drafter.start(f"r{n}-{r}", n + 100, False)
            engine.drafter.draft(f"r{n}-{r}", torch.cat([prompt[1:], torch.tensor([pre.first_token])]), pre.features)
            c2, t2 = time.thread_time(), time.perf_counter()
            engine.verifier.release(f"r{n}-{r}")
            engine.drafter.release(f"r{n}-{r}")
            times.append((t1 - t0, t2 - t1, c1 - c0, c2 - c1))
        med = [round(statistics.median(t[i] for t in times), 3) for i in range(4)]
        out[n] = {"verifier_prefill_wall_s": med[0], "drafter_refill_wall_s": med[1],
                  "verifier_prefill_cpu_s": med[2], "drafter_refill_cpu_s": med[3]}
        print(n, out[n], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/failover.json")
    p.add_argument("--workdir", default="/tmp")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=240)
    p.add_argument("--gap-s", type=float, default=6.0)
    p.add_argument("--lengths", default="64,256,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-faults", action="store_true")
    p.add_argument("up_args", nargs="*", help="extra `aerie up` flags (after --)")
    args = p.parse_args()
    report = {}
    if not args.skip_faults:
        report["faults"] = faults(args)
        Path(args.out).write_text(json.dumps(report, indent=1))
    report["rebuild"] = rebuild_cost([int(x) for x in args.lengths.split(",")], args.repeats)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
