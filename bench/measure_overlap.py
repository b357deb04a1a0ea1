"""Drafting ahead through the services: the same prompts through `aerie up` pipelines (one
coordinator, verifier and drafter each, every one its own process), one serial and one per
`--modes` entry with `--overlap MODE` (DraftAhead overlapping each Verify; "on": the learning
policy, "always": whenever a guess can hit), interleaved per prompt (the order rotates) so machine
noise hits all alike, plus the same EAGLE engine in process (and, with `--in-process-ahead on,always`,
that engine drafting ahead on a thread of its own); ratios from the same run. `--baseline-up-args`
adds one more serial pipeline with other flags (an A/B of a flag in the same run).

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_overlap.py --tiny --max-new-tokens 48 \
        --repeats 3 --out bench/results/overlap-tiny-t1.json
    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_overlap.py --prompts ../shared/data/spec_bench_dev.jsonl \
        --per-category 1 --max-new-tokens 48 --modes on,always   # the default model and its shipped head

`--tiny` builds the tests' tiny Llama with a distilled EAGLE-2 head (tests/helpers.py: the "tiny
bench model" of `aerie bench`'s tests, fp32, tree 16/3/4) in a temporary directory. The overlap
pipeline's coordinator runs its own policy (services/spec/overlap.py: it learns hit rates and the
contention it measures, and turns drafting ahead off where it cannot pay). Each service process
gets AERIE_TORCH_THREADS threads (the report says how many) and so does the in-process engine.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from up_process import coordinator_address, start_up, stop_all  # noqa: E402  (bench/)
from report import emit  # noqa: E402  (bench/)


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` on `cpus` (sched_setaffinity moves one thread; new threads inherit)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def pin_pipeline(up_pid: int, lines: list[str], verify_cpus: set[int], other_cpus: set[int]) -> None:
    """The processes `aerie up` printed ("NAME ADDRESS (pid N...)"): verifiers on `verify_cpus`, the
    others and `aerie up` itself on `other_cpus`."""
    pin_process(up_pid, other_cpus)
    for line in lines:
        m = re.match(r"^(\S+)\s.*\(pid (\d+)", line)
        if m:
            pin_process(int(m.group(2)), verify_cpus if m.group(1).startswith("verifier") else other_cpus)


def summary(runs: list) -> dict:
    rounds = sum(r.rounds for r in runs)
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    ahead = sum(r.ahead_rounds for r in runs)
    return {"tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "rounds": rounds,
            "tau": round(tokens / max(rounds, 1), 3), "round_ms": round(1e3 * sum(r.round_s for r in runs) / max(rounds, 1), 2),
            "draft_ms": round(1e3 * sum(r.draft_s for r in runs) / max(rounds, 1), 2),
            "verify_ms": round(1e3 * sum(r.verify_s for r in runs) / max(rounds, 1), 2),
            "ahead_share": round(ahead / max(rounds, 1), 3),
            "guess_hit_rate": round(sum(r.ahead_hits for r in runs) / ahead, 3) if ahead else None,
            "ahead_wait_ms": round(1e3 * sum(r.ahead_wait_s for r in runs) / max(rounds, 1), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny Llama + distilled head (else --target/--draft)")
    p.add_argument("--tiny-tree", choices=("fixed", "auto"), default="fixed",
                   help="with --tiny: the fixed 16/3/4 tree, or the adaptive budget (drafters and the in-process "
                        "engine without a tree: each round's shape planned)")
    p.add_argument("--tiny-layers", type=int, default=2,
                   help="--tiny: the target's layers (more: a verify longer than the one-layer head's draft)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompts", default=None, help="Spec-Bench JSONL (--tiny: its own four prompts)")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--per-category", type=int, default=0, help="the first N prompts of each category (0: all)")
    p.add_argument("--categories", default="", help="comma list: only these Spec-Bench categories (e.g. summarization,rag)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled requests (top_p 0.95, prompt i seeded with i; every side draws different "
                        "tokens from the same distributions, so `exact` is for greedy runs only)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--modes", default="on", help="comma list of overlap modes to run beside the serial pipeline: on,always")
    p.add_argument("--up-args", default="", help="extra `aerie up` flags for both pipelines, space separated")
    p.add_argument("--baseline-up-args", default=None,
                   help="start one more serial pipeline with these extra `aerie up` flags (e.g. '--plain-run 0'), "
                        "named serial-baseline, in the same interleaved run (an A/B of a flag)")
    p.add_argument("--baseline", default=None,
                   help="start the serial-baseline pipeline from this checkout's code (its .venv's python, "
                        "else this interpreter run from that directory): an A/B of code, e.g. --baseline "
                        "/tmp/base '--baseline-up-args=--overlap always' against this tree's overlap-always")
    p.add_argument("--in-process-ahead", default="",
                   help="comma list of overlap modes (on,always) to run the in-process engine with too")
    p.add_argument("--pin", action="store_true",
                   help="a core per role: each pipeline's verifier on CPU 0, its other processes (aerie up, "
                        "coordinator, drafter, gateway, Redis) on the other CPUs; this process on CPU 0 while "
                        "the in-process engine runs and on the others while it waits for a pipeline")
    p.add_argument("--out", default=None, help="JSON here")
    args = p.parse_args()
    if args.baseline and args.baseline_up_args is None:
        p.error("--baseline needs --baseline-up-args (the baseline pipeline's flags; '' for the serial one)")
    load_start = os.getloadavg()

    from aerie_cli.flags import set_torch_threads
    from services.bench.bench import load_prompts, run_steps
    from services.engine.engine import GenerationRequest
    from services.spec.sampling import SamplingParams
    from services.engine.local import build_local_engine
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession

    set_torch_threads()
    tmp = tempfile.TemporaryDirectory()
    model = []
    if args.tiny:
        from tests.helpers import distill_head, save_bench_dirs, tiny_hf, to_native

        hf = tiny_hf("llama", layers=args.tiny_layers, seed=0)
        target = to_native(hf)
        root = save_bench_dirs((hf, target, distill_head(target, "eagle", seed=0)), Path(tmp.name))
        args.target, args.draft = str(root / "target"), str(root / "head")
        args.prompts = args.prompts or str(root / "prompts.jsonl")
        model = ["--tree-tokens", "16", "--tree-depth", "3", "--tree-top-k", "4"] if args.tiny_tree == "fixed" else []
    model += ["--dtype", args.dtype] + (["--target", args.target] if args.target else []) + ["--draft", args.draft]
    # the split pipeline unless --up-args ask for direct drafts (`aerie up`'s default since the sixth session)
    env = {**os.environ, "AERIE_LOG_LEVEL": "WARNING", "AERIE_OVERLAP": "0", "AERIE_DIRECT_DRAFTS": "0"}
    argv = ["--port", "0", "--http-port", "0", *model, *args.up_args.split()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    names = ["serial", *(["serial-baseline"] if args.baseline_up_args is not None else []),
             *(f"overlap-{m}" for m in modes)]
    lines: dict[str, list[str]] = {name: [] for name in names}
    ups = {"serial": start_up(argv, env, lines["serial"])}
    try:
        if args.baseline_up_args is not None:
            python = Path(args.baseline) / ".venv/bin/python" if args.baseline else None
            ups["serial-baseline"] = start_up([*argv, *args.baseline_up_args.split()], env, lines["serial-baseline"],
                                              str(python) if python is not None and python.exists() else sys.executable,
                                              args.baseline)
        for m in modes:
            ups[f"overlap-{m}"] = start_up([*argv, "--overlap", m], env, lines[f"overlap-{m}"])
        sessions = {name: RemoteSession(coordinator_address(lines[name]), None, "", None) for name in ups}
        cpus = sorted(os.sched_getaffinity(0))
        verify_cpus, other_cpus = set(cpus[:1]), set(cpus[1:]) or set(cpus)
        if args.pin:
            for name, up in ups.items():
                pin_pipeline(up.pid, lines[name], verify_cpus, other_cpus)
        from services.spec.tree import TreeParams

        local = build_local_engine(args.target, args.draft, args.dtype,
                                   TreeParams(4, 3, 16) if args.tiny and args.tiny_tree == "fixed" else None)
        prompts = load_prompts(args.prompts, local.tokenizer, args.limit, args.per_category,
                               [c.strip() for c in args.categories.split(",") if c.strip()])
        from services.spec.overlap import AheadPolicy

        local_modes = [m.strip() for m in args.in_process_ahead.split(",") if m.strip()]
        engines = {"in_process": local.engine}
        for m in local_modes:  # the same engine code with drafting ahead (a drafter thread in process)
            other = build_local_engine(args.target, args.draft, args.dtype, TreeParams(4, 3, 16) if args.tiny and args.tiny_tree == "fixed" else None)
            other.engine.ahead = AheadPolicy(contention=0.0, learn_cost=False) if m == "always" else AheadPolicy()
            other.engine.drafter.ahead_branches = 2  # the draft KV's ahead rows, as `aerie up --overlap` drafters
            engines[f"in_process-{m}"] = other.engine

        def request(prompt, n):
            if not args.temperature:
                return GenerationRequest(prompt.ids, n)
            seed = next(i for i, p in enumerate(prompts) if p is prompt)
            return GenerationRequest(prompt.ids, n, SamplingParams(args.temperature, top_p=0.95, seed=seed))

        def pipeline(name, prompt, n=args.max_new_tokens):
            req = request(prompt, n)
            if args.pin:
                pin_process(os.getpid(), other_cpus)
            return run_steps(lambda: RemoteEngine(sessions[name]).generate(req))

        def in_process(engine, prompt, n=args.max_new_tokens):
            if args.pin:
                pin_process(os.getpid(), verify_cpus)
            return run_steps(lambda: engine.generate(request(prompt, n)))

        for name in ups:  # warm-up: first-call allocations in every process
            pipeline(name, prompts[0], 8)
        for engine in engines.values():
            in_process(engine, prompts[0], 4)
        runs: dict[str, list] = {name: [] for name in [*names, *engines]}
        t0 = time.perf_counter()
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                k = (i + rep) % len(names)
                for name in names[k:] + names[:k]:
                    runs[name].append(pipeline(name, prompt))
                for name, engine in engines.items():
                    runs[name].append(in_process(engine, prompt))
            print(f"pass {rep + 1}/{args.repeats}: {time.perf_counter() - t0:.0f}s", flush=True)
        for s in sessions.values():
            s.close()
    finally:
        stop_all(ups)
        tmp.cleanup()
    report: dict = {name: summary(r) for name, r in runs.items()}
    def ratio(a: str, b: str) -> float:
        return round(report[a]["tokens_per_s"] / report[b]["tokens_per_s"], 3)

    report["serial_vs_in_process"] = ratio("serial", "in_process")
    if args.baseline_up_args is not None:
        report["serial-baseline_vs_in_process"] = ratio("serial-baseline", "in_process")
        report["serial_vs_serial-baseline"] = ratio("serial", "serial-baseline")
        for m in modes:
            report[f"overlap-{m}_vs_serial-baseline"] = ratio(f"overlap-{m}", "serial-baseline")
    for m in modes:
        report[f"overlap-{m}_vs_serial"] = ratio(f"overlap-{m}", "serial")
        report[f"overlap-{m}_vs_in_process"] = ratio(f"overlap-{m}", "in_process")
    for name in runs:
        if name.startswith("in_process-"):
            report[f"{name}_vs_in_process"] = ratio(name, "in_process")
    report["exact"] = all(len({tuple(r.tokens) for r in rows}) == 1 for rows in zip(*runs.values()))
    report["config"] = {"model": f"tiny (tests/helpers.py), {args.tiny_layers} layers, {args.tiny_tree} tree" if args.tiny else args.target or "default",
                        "draft": args.draft, "prompts": len(prompts), "prompt_file": args.prompts,
                        "categories": args.categories, "per_category": args.per_category, "repeats": args.repeats,
                        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                        "torch_threads_per_process": os.environ.get("AERIE_TORCH_THREADS", "default"),
                        "pinned": args.pin,
                        "modes": modes, "up_args": args.up_args, "baseline_up_args": args.baseline_up_args,
                        "baseline": args.baseline, "cpus": os.cpu_count(), "load_average_start": load_start,
                        "load_average": os.getloadavg()}
    emit(report, args.out)


if __name__ == "__main__":
    main()
