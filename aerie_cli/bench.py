"""`aerie bench`: hf generate vs aerie plain vs aerie EAGLE-2 (vs the pipeline) on a prompt set.

    aerie bench --prompts ../shared/data/spec_bench_dev.jsonl --limit 24 --json-out bench.json --chart bench.png
    aerie bench --sweep ...   # tree tokens/depth/top_k grid for EAGLE-2 only; reports the best
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

from aerie_cli.flags import add_command, add_model_flags, dtype, tree_params
from services.errors import InvalidRequest

SWEEP = [(8, 7, 1), (6, 4, 2), (10, 4, 2), (12, 3, 3), (16, 4, 4), (16, 5, 3), (24, 5, 4), (32, 5, 6),
         (60, 5, 10)]  # (tokens, depth, top_k)


def register(sub) -> None:
    p = add_command(sub, "bench", "measure speed-ups on a prompt set (prints a table, writes JSON)", __doc__)
    add_model_flags(p)
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL (question_id, category, turns); required")
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0 = all)")
    p.add_argument("--per-category", type=int, default=0, help="first N prompts of each category (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--methods", default="hf,native,eagle", help="comma list of hf,native,eagle,pipeline")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of a running pipeline (method 'pipeline'; default: none)")
    p.add_argument("--sweep", action="store_true", help="grid of tree shapes for EAGLE-2")
    p.add_argument("--json-out", default=None, help="write the results as JSON here (default: not written)")
    p.add_argument("--chart", default=None,
                   help="PNG chart path (needs matplotlib: pip install 'aerie[bench]'; default: no chart)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from services.bench.bench import HFBaseline, load_prompts, run_engine, summarize
    from services.bench.report import chart, table
    from services.engine.local import DTYPES, build_local_engine
    from services.spec.tree import TreeParams

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - {"hf", "native", "eagle", "pipeline"}
    if unknown or "hf" not in methods:
        raise InvalidRequest(f"--methods must include hf and only hf,native,eagle,pipeline; got {args.methods!r}")
    if args.chart and importlib.util.find_spec("matplotlib") is None:  # before the long run, not after
        raise InvalidRequest("--chart needs matplotlib: pip install 'aerie[bench]'")
    if "pipeline" in methods and not args.coordinator:
        raise InvalidRequest("method 'pipeline' needs --coordinator HOST:PORT (start one with `aerie up`)")
    tree = tree_params(args)
    local = build_local_engine(args.target, args.draft, dtype(args), tree, args.draft_vocab, args.draft_dtype)
    if local.engine.drafter is None and ("eagle" in methods or args.sweep):
        raise InvalidRequest("method 'eagle' needs a draft head: pass --draft DIR")
    prompts = load_prompts(args.prompts, local.tokenizer, args.limit, args.per_category)
    engine = local.engine
    plain = type(engine)(engine.verifier, None, engine.max_context, engine.vocab_size, engine.eos_token_ids)
    hf = HFBaseline(local.model_dir, DTYPES[dtype(args)], engine.eos_token_ids)
    # warm up every path once (first-call allocations and kernel selection)
    hf.run(prompts[0], 4)
    run_engine(plain, prompts[0], 4)
    if engine.drafter:
        run_engine(engine, prompts[0], 4)

    shapes = [TreeParams(k, d, n) for n, d, k in SWEEP] if args.sweep else \
        ([tree] if "eagle" in methods else [])
    runs: dict[str, list] = {m: [] for m in methods if m != "eagle"}
    for shape in shapes:
        runs[_eagle_name(shape, args.sweep)] = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        # interleave methods per prompt so machine noise hits all of them alike
        runs["hf"].append(hf.run(prompt, args.max_new_tokens))
        if "native" in runs:
            runs["native"].append(run_engine(plain, prompt, args.max_new_tokens))
        for shape in shapes:
            engine.drafter.tree = shape
            runs[_eagle_name(shape, args.sweep)].append(run_engine(engine, prompt, args.max_new_tokens))
        if "pipeline" in runs:
            runs["pipeline"].append(_pipeline_run(args, prompt))
        print(f"[{i + 1}/{len(prompts)}] {prompt.category} {time.perf_counter() - t0:.0f}s", flush=True)
    result = summarize(runs, prompts)
    result["config"] = {"target": local.target_path, "draft": local.draft_path, "dtype": dtype(args),
                        "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
                        "limit": args.limit, "per_category": args.per_category, "torch_threads": __import__("torch").get_num_threads()}
    if args.sweep:
        eagle_rows = {m: r for m, r in result["methods"].items() if m.startswith("eagle")}
        best = max(eagle_rows, key=lambda m: eagle_rows[m]["tokens_per_s"])
        result["best_tree"] = best
    print(table(result))
    if args.sweep:
        print(f"best tree: {result['best_tree']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if args.chart:
        chart(result, args.chart, f"aerie bench ({dtype(args)}, {len(prompts)} prompts)")
    return 0


def _eagle_name(shape, sweep: bool) -> str:
    return f"eagle{shape.total_tokens}/{shape.depth}/{shape.top_k}" if sweep else "eagle"


def _pipeline_run(args, prompt):
    from services.bench.bench import run_steps
    from services.engine.engine import GenerationRequest
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession

    req = GenerationRequest(prompt.ids, args.max_new_tokens)
    session = RemoteSession(args.coordinator, None, "", None)
    try:
        return run_steps(lambda: RemoteEngine(session).generate(req))
    finally:
        session.close()
