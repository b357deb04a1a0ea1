"""Where a pipeline round's time goes: the same prompts through `aerie up` (one coordinator,
verifier and drafter, each its own process) and in process (EAGLE, the same engine code), per round
and per process.

Per round, from the client's stream (as `aerie bench` times it): the round, the coordinator's draft
and verify calls (RPC included). From each service's Prometheus histograms: the service's own time
for the same calls (decode, batcher hop, model work, encode; no gRPC). From /proc: the CPU time each
process spent per round (contention on a small machine: the processes share its cores).

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_pipeline_overhead.py \
        --prompts ../shared/data/spec_bench_dev.jsonl --limit 4 --max-new-tokens 32 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from up_process import start_up  # noqa: E402  (bench/)
from report import emit  # noqa: E402  (bench/)

HISTOGRAMS = ("aerie_verify_seconds", "aerie_draft_seconds", "aerie_commit_seconds", "aerie_prefill_seconds")


def scrape(url: str) -> dict[str, float]:
    """`name_sum` / `name_count` of the histograms above -> value (every label summed)."""
    out: dict[str, float] = {}
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        m = re.match(r"^(aerie_\w+?_seconds)_(sum|count)\{[^}]*\} ([0-9.e+-]+)$", line)
        if m and m.group(1) in HISTOGRAMS:
            key = f"{m.group(1)}_{m.group(2)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid` ("name/tid" -> seconds)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--per-category", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (each: pipeline, then in process)")
    p.add_argument("--up-args", default="", help="extra `aerie up` flags, space separated")
    p.add_argument("--no-local", action="store_true", help="skip the in-process runs")
    p.add_argument("--baseline", default=None,
                   help="another checkout (`git archive BASE | tar -x -C DIR`; `.`: this one): its `aerie up` runs "
                        "the same prompts, interleaved with this one's (A/B)")
    p.add_argument("--baseline-up-args", default=None,
                   help="the baseline's `aerie up` flags (default: --up-args), e.g. --up-args=--colocate "
                        "--baseline . --baseline-up-args= : the colocated pipeline against the split one")
    p.add_argument("--out", default=None, help="JSON here")
    args = p.parse_args()

    from aerie_cli.flags import set_torch_threads
    from services.bench.bench import load_prompts, run_engine, run_steps
    from services.engine.engine import GenerationRequest
    from services.engine.local import build_local_engine
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession

    set_torch_threads()
    # the split pipeline unless --up-args ask for direct drafts (`aerie up`'s default since the sixth session)
    env = {**os.environ, "AERIE_LOG_LEVEL": "WARNING", "AERIE_DIRECT_DRAFTS": "0"}
    lines: list[str] = []
    up = start_up(["--port", "0", "--http-port", "0", *args.up_args.split()], env, lines)
    try:
        procs = {}
        for line in lines:
            m = re.match(r"^(coordinator|verifier|drafter)\s+(\S+) \(pid (\d+), metrics (\S+)\)", line)
            if m:
                procs[m.group(1)] = {"address": m.group(2), "pid": int(m.group(3)), "metrics": m.group(4)}
        coordinator = procs["coordinator"]["address"]
        local = None if args.no_local else build_local_engine(None, "auto", "fp32")
        tokenizer = local.tokenizer if local else build_local_engine(None, "none", "fp32").tokenizer
        prompts = load_prompts(args.prompts, tokenizer, args.limit, args.per_category)
        session = RemoteSession(coordinator, None, "", None)
        base_session = None
        if args.baseline:
            base_lines: list[str] = []
            python = Path(args.baseline) / ".venv/bin/python"  # else this interpreter, run from that directory
            base_args = args.up_args if args.baseline_up_args is None else args.baseline_up_args
            base_up = start_up(["--port", "0", "--http-port", "0", *base_args.split()], env, base_lines,
                               str(python) if python.exists() else sys.executable, args.baseline)
            base_address = next(m.group(1) for line in base_lines
                                if (m := re.match(r"^coordinator\s+(\S+) \(pid", line)))
            base_session = RemoteSession(base_address, None, "", None)

        def pipeline(prompt, s=session):
            req = GenerationRequest(prompt.ids, args.max_new_tokens)
            return run_steps(lambda: RemoteEngine(s).generate(req))

        if base_session is not None:
            pipeline(prompts[0], base_session)
        pipeline(prompts[0])  # warm-up: first-call allocations in every process
        if local:
            run_engine(local.engine, prompts[0], 4)
        agg = {"pipeline": [], "local": [], "baseline": []}
        svc0 = {r: scrape(p["metrics"]) for r, p in procs.items()}
        cpu = {r: 0.0 for r in [*procs, "client"]}
        threads = {r: {} for r in procs}
        local_cpu = 0.0
        for _ in range(args.repeats):
            for prompt in prompts:  # interleaved, so that machine noise hits both alike
                c0 = {r: cpu_s(p["pid"]) for r, p in procs.items()}
                t0 = {r: thread_cpu_s(p["pid"]) for r, p in procs.items()}
                s0 = time.process_time()
                agg["pipeline"].append(pipeline(prompt))
                cpu["client"] += time.process_time() - s0
                for r, p in procs.items():
                    cpu[r] += cpu_s(p["pid"]) - c0[r]
                    for t, v in thread_cpu_s(p["pid"]).items():
                        threads[r][t] = threads[r].get(t, 0.0) + v - t0[r].get(t, 0.0)
                if base_session is not None:
                    agg["baseline"].append(pipeline(prompt, base_session))
                if local:
                    s0 = time.process_time()
                    agg["local"].append(run_engine(local.engine, prompt, args.max_new_tokens))
                    local_cpu += time.process_time() - s0
        svc1 = {r: scrape(p["metrics"]) for r, p in procs.items()}
        session.close()
        if base_session is not None:
            base_session.close()
    finally:
        up.terminate()
        up.wait(60)
        if args.baseline and "base_up" in locals():
            base_up.terminate()
            base_up.wait(60)

    report: dict = {"prompts": len(prompts), "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
                    "threads": os.environ.get("AERIE_TORCH_THREADS"), "up_args": args.up_args,
                    "baseline_up_args": args.baseline_up_args}
    for name, runs in agg.items():
        if not runs:
            continue
        rounds = sum(r.rounds for r in runs)
        tokens = sum(len(r.tokens) for r in runs)
        report[name] = {
            "tokens_per_s": tokens / sum(r.seconds for r in runs), "rounds": rounds,
            "tau": tokens / max(rounds, 1),
            "round_ms": 1e3 * sum(r.round_s for r in runs) / rounds,
            "draft_ms": 1e3 * sum(r.draft_s for r in runs) / rounds,
            "verify_ms": 1e3 * sum(r.verify_s for r in runs) / rounds,
            "tree": sum(r.tree_nodes for r in runs) / rounds,
        }
    if agg["local"]:
        report["exact"] = all(a.tokens == b.tokens for a, b in zip(agg["pipeline"], agg["local"]))
        report["local"]["cpu_ms_per_round"] = 1e3 * local_cpu / report["local"]["rounds"]
        report["ratio"] = report["pipeline"]["tokens_per_s"] / report["local"]["tokens_per_s"]
        if agg["baseline"]:
            report["baseline_ratio"] = report["baseline"]["tokens_per_s"] / report["local"]["tokens_per_s"]
            report["baseline_exact"] = all(a.tokens == b.tokens for a, b in zip(agg["baseline"], agg["local"]))
    rounds = report["pipeline"]["rounds"]
    svc = {}
    for role in procs:
        d = {k: svc1[role].get(k, 0.0) - svc0[role].get(k, 0.0) for k in svc1[role]}
        for h in HISTOGRAMS:
            n = d.get(f"{h}_count", 0.0)
            if n:
                svc[f"{role}.{h[6:-8]}"] = {"calls": int(n), "ms_per_call": 1e3 * d[f"{h}_sum"] / n}
    report["service_ms"] = svc
    report["cpu_ms_per_round"] = {r: 1e3 * v / rounds for r, v in cpu.items()}
    report["thread_cpu_ms_per_round"] = {
        r: {t: round(1e3 * v / rounds, 2) for t, v in sorted(ts.items(), key=lambda kv: -kv[1]) if v > 0}
        for r, ts in threads.items()}
    emit(report, args.out)


if __name__ == "__main__":
    main()
