"""The rounds of the same requests in process and through `aerie up` pipelines, by kind: how many are
plain or tree rounds, inside runs (DecodeRun, VerifyRun) or single calls, and the wall between two
streamed rounds of each kind (what a round of that kind costs the client), the tokens a round and the
mean tree size; apart, a request's prefill (to its first token) and its first round (whose draft
takes the prompt's rows first), mean ms. Where the pipeline's time goes against the engine in process, round by round.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_round_mix.py \\
        --prompts ../shared/data/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 48 \\
        --pipelines "direct=--direct-drafts;colocated=--colocate" --out mix.json

The default model (`--target`/`--draft` pick others), fp32, greedy; the prompts go to every side in
turn (in process first), after one warm-up request each. Kinds: `plain` (one Decode call), `plain-run`
(a plain step from a run), `detached` (a plain step with the drafter detached), `tree` (one Verify
call), `tree-run` (a tree round from a run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import emit  # noqa: E402  (bench/)
from up_process import coordinator_address, start_up, stop_all  # noqa: E402  (bench/)


def kind(stats) -> str:
    """A round's kind (module doc) from its RoundStats."""
    if stats.tree_size <= 1:
        return "plain-run" if stats.run else "detached" if stats.detached else "plain"
    return "tree-run" if stats.tree_run else "tree"


def mean_ms(walls: list[float]) -> float | None:
    return round(1e3 * statistics.mean(walls), 2) if walls else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default="auto")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompts", required=True, help="Spec-Bench JSONL")
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--pipelines", default="direct=--direct-drafts;colocated=--colocate",
                   help="NAME=`aerie up` flags (space separated), ';' between pipelines")
    p.add_argument("--out", default=None, help="JSON here")
    args = p.parse_args()

    from aerie_cli.flags import set_torch_threads
    from services.bench.bench import load_prompts
    from services.engine.engine import GenerationRequest
    from services.engine.local import build_local_engine
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession

    set_torch_threads()
    model = ["--dtype", args.dtype, "--draft", args.draft] + (["--target", args.target] if args.target else [])
    env = {**os.environ, "AERIE_LOG_LEVEL": "WARNING", "AERIE_OVERLAP": "0", "AERIE_DIRECT_DRAFTS": "0"}
    pipelines = dict(part.split("=", 1) for part in args.pipelines.split(";") if part.strip())
    ups, lines = {}, {name: [] for name in pipelines}
    try:
        for name, flags in pipelines.items():
            ups[name] = start_up(["--port", "0", "--http-port", "0", *model, *flags.split()], env, lines[name])
        sessions = {name: RemoteSession(coordinator_address(lines[name]), None, "", None) for name in ups}
        local = build_local_engine(args.target, args.draft, args.dtype, None)
        prompts = load_prompts(args.prompts, local.tokenizer, args.limit, args.per_category)
        sides = {"in_process": lambda req: local.engine.generate(req),
                 **{name: (lambda req, s=sessions[name]: RemoteEngine(s).generate(req)) for name in ups}}
        rounds: dict[str, dict[str, list]] = {side: defaultdict(list) for side in sides}
        seconds = dict.fromkeys(sides, 0.0)
        starts: dict[str, tuple[list, list]] = {side: ([], []) for side in sides}  # (prefill, first round) walls
        for generate in sides.values():  # warm-up
            list(generate(GenerationRequest(prompts[0].ids, 8)))
        for prompt in prompts:
            for side, generate in sides.items():
                t0 = last = time.perf_counter()
                for i, out in enumerate(generate(GenerationRequest(prompt.ids, args.max_new_tokens))):
                    now = time.perf_counter()
                    if i == 0:  # the prefill and its token
                        starts[side][0].append(now - last)
                    elif i == 1:  # the first round: its draft takes the prompt's rows (their features)
                        starts[side][1].append(now - last)
                    else:
                        rounds[side][kind(out.stats)].append((now - last, len(out.tokens), out.stats.tree_size))
                    last = now
                seconds[side] += time.perf_counter() - t0
        for s in sessions.values():
            s.close()
    finally:
        stop_all(ups)
    report: dict = {}
    for side, kinds in rounds.items():
        report[side] = {"seconds": round(seconds[side], 3),
                        "prefill_ms": mean_ms(starts[side][0]), "first_round_ms": mean_ms(starts[side][1]),
                        "kinds": {
            k: {"rounds": len(v), "mean_ms": round(1e3 * statistics.mean(x[0] for x in v), 2),
                "tokens_per_round": round(statistics.mean(x[1] for x in v), 3),
                "mean_tree": round(statistics.mean(x[2] for x in v), 2)} for k, v in sorted(kinds.items())}}
        report[f"{side}_vs_in_process"] = round(seconds["in_process"] / seconds[side], 3)
    report["config"] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "pipelines": pipelines,
                        "torch_threads_per_process": os.environ.get("AERIE_TORCH_THREADS", "default"),
                        "load_average": os.getloadavg()}
    emit(report, args.out)


if __name__ == "__main__":
    main()
