"""`aerie bench`: hf generate vs aerie plain vs EAGLE-2 (auto budget) vs retrieval (sam, eagle+sam)
(vs the pipeline) on a prompt set, in one run.

    aerie bench --prompts ../shared/data/spec_bench_dev.jsonl --per-category 2 --max-new-tokens 64 \
        --json-out bench.json --chart bench.png
    aerie bench --sweep ...   # fixed tree shapes and auto for EAGLE-2; the cost model's predicted
                              # tok/s next to the measured one per shape; reports the best
    aerie bench --prompts ... --concurrency 1,2,4,8,16 --json-out c.json --chart c.png
                              # N sequences at once through in-process services (continuous
                              # batching): plain, a fixed tree, the adaptive budget
                              # (aerie_cli/bench_concurrency.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

from aerie_cli.flags import add_command, add_model_flags, device, dtype, tree_params
from services.errors import InvalidRequest

SWEEP = [(2, 0, 1), (3, 1, 1), (4, 2, 1), (6, 4, 1), (8, 6, 1), (6, 2, 2), (10, 3, 2), (16, 3, 4),
         (32, 5, 4)]  # (tokens, depth, top_k); a chain of L drafts is (L + 1, L - 1, 1)
METHODS = ("hf", "native", "eagle", "sam", "eagle+sam", "eagle+ahead", "pipeline")


def register(sub) -> None:
    p = add_command(sub, "bench", "measure speed-ups on a prompt set (prints a table, writes JSON)", __doc__)
    add_model_flags(p)
    p.add_argument("--prompts", default=None,
                   help="Spec-Bench style JSONL (question_id, category, turns); required unless --shape")
    gpu = p.add_argument_group("model-free device benchmark (services/bench/gpu.py)")
    gpu.add_argument("--shape", default=None,
                     help="random weights of this shape built on --device, no download: llama-3.1-8b, llama-3.2-1b, "
                          "smollm2-135m or tiny; reports the bandwidth floor, the bare forward, kernels per forward, "
                          "plain decoding, fixed-tree rounds in plain tokens, batched decode and transformers' eager "
                          "generate (default: off)")
    gpu.add_argument("--prompt-tokens", type=int, default=512, help="--shape: prompt length (default: 512)")
    gpu.add_argument("--batches", default="1,8,32", help="--shape: batched decode sizes (default: 1,8,32)")
    gpu.add_argument("--no-hf", action="store_true", help="--shape: skip transformers' generate")
    gpu.add_argument("--no-legacy", action="store_true",
                     help="--shape: skip the pre-paged path (contiguous KV, SDPA's own kernel)")
    gpu.add_argument("--paged-attention", default="auto", choices=("auto", "on", "off"),
                     help="--shape: measure AERIE_ATTENTION=paged (the Triton kernel) next to the default: auto = on "
                          "CUDA when triton imports; on = also elsewhere (the CPU needs TRITON_INTERPRET=1)")
    gpu.add_argument("--pipeline", action="store_true",
                     help="--shape: instead, plain and EAGLE decoding through `aerie up` (separate processes, gRPC, "
                          "Redis) against the in-process engine on the same random checkpoint written to a temporary "
                          "directory (services/bench/pipeline_shape.py; --max-new-tokens a request, --repeats)")
    gpu.add_argument("--pipelines", default=None,
                     help="--shape --pipeline: comma list of eagle,colocated,colocated-host,direct,plain, measured in that "
                          "order (colocated-host: --colocate with AERIE_DEVICE_ROUND=0) (default: eagle,colocated,direct,"
                          "plain)")
    gpu.add_argument("--interleave", action="store_true",
                     help="--shape --pipeline: start every pipeline at once and take their requests in turn (an A/B "
                          "that the machine's drift or the order of the starts cannot favour; needs the memory of all)")
    gpu.add_argument("--profile", default=None, metavar="DIR",
                     help="--shape --pipeline: sample each service process with py-spy while its requests run (every "
                          "thread, and the one holding the interpreter lock): raw stacks in DIR, a summary per thread "
                          "in the table and the JSON (services/bench/service_profile.py; needs py-spy) (default: no profile)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0 = all)")
    p.add_argument("--per-category", type=int, default=0, help="first N prompts of each category (0 = all)")
    p.add_argument("--categories", default=None,
                   help="comma list of categories to run, e.g. summarization,rag (default: all of the file's)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--methods", default=None,
                   help="comma list of hf,native,eagle,sam,eagle+sam,eagle+ahead,pipeline (default: hf,native,eagle,sam,"
                        "eagle+sam; with --concurrency: none, only the concurrency sweep runs)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of a running pipeline (method 'pipeline'; default: none)")
    p.add_argument("--sweep", action="store_true", help="grid of fixed tree shapes and auto for EAGLE-2, with the cost model's predicted tok/s")
    p.add_argument("--tp-verify", type=int, default=0,
                   help="also measure verify latency at TP=1 and TP=N (a local group of N ranks; 0 = off)")
    c = p.add_argument_group("concurrency (continuous batching, through the services)")
    c.add_argument("--concurrency", default=None,
                   help="comma list of concurrent sequences, e.g. 1,2,4,8,16: aggregate tok/s and ITL for plain, "
                        "a fixed tree and the adaptive budget through in-process services (default: off)")
    c.add_argument("--concurrency-methods", default="plain,tree,adaptive",
                   help="methods of the concurrency sweep: plain, tree, adaptive, overlap (adaptive drafting "
                        "ahead: --overlap on), direct (the fixed tree with --direct-drafts), direct-ahead (direct with "
                        "--overlap on: the verifier drafts ahead in runs) (default: plain,tree,adaptive)")
    c.add_argument("--repeats", type=int, default=1,
                   help="concurrency sweep repeats, and --shape --pipeline's requests a side; the tables show the median "
                        "(default: 1)")
    c.add_argument("--max-batch", type=int, default=16, help="the services' calls per forward (default: 16)")
    c.add_argument("--max-batch-rows", type=int, default=1024, help="the services' rows per forward (default: 1024)")
    c.add_argument("--prefill-chunk", type=int, default=None,
                   help="the verifier's prompt tokens per prefill forward, 0 = whole prompts "
                        "(default: the verifier's own default, 512)")
    c.add_argument("--verifier-threads", type=int, default=None,
                   help="torch threads of the verifier process alone (its AERIE_TORCH_THREADS); the drafters and "
                        "coordinators keep this process's AERIE_TORCH_THREADS (default: the same for all)")
    p.add_argument("--json-out", default=None, help="write the results as JSON here (default: not written)")
    p.add_argument("--chart", default=None,
                   help="PNG chart path (needs matplotlib: pip install 'aerie[bench]'; default: no chart)")
    p.set_defaults(func=cmd_bench)
    from aerie_cli import bench_serve  # `aerie bench serve`: against a running server

    bench_serve.register(p.add_subparsers(dest="bench_mode", metavar="{serve}", required=False))


def cmd_bench(args: argparse.Namespace) -> int:
    if args.shape:
        return _shape_bench(args)
    if not args.prompts:
        raise InvalidRequest("aerie bench needs --prompts FILE (or --shape NAME for the model-free device benchmark, "
                             "or `aerie bench serve` against a running server)")
    from dataclasses import replace

    from services.bench.bench import HFBaseline, load_prompts, run_engine, summarize
    from services.bench.report import chart, table
    from services.engine.engine import Engine
    from services.engine.local import DTYPES, build_local_engine
    from services.spec.budget import CHAIN_LIMIT
    from services.spec.tree import TreeParams

    if args.concurrency:
        from aerie_cli.bench_concurrency import METHODS as CONC_METHODS
        from aerie_cli.bench_concurrency import parse_levels

        parse_levels(args.concurrency)
        bad = {m.strip() for m in args.concurrency_methods.split(",") if m.strip()} - set(CONC_METHODS)
        if bad or not args.concurrency_methods.strip():
            raise InvalidRequest(f"--concurrency-methods must be a comma list of {','.join(CONC_METHODS)}; "
                                 f"got {args.concurrency_methods!r}")
        if args.repeats < 1:
            raise InvalidRequest(f"--repeats must be >= 1; got {args.repeats}")
        if args.verifier_threads is not None and args.verifier_threads < 1:
            raise InvalidRequest(f"--verifier-threads must be >= 1; got {args.verifier_threads}")
    default = "" if args.concurrency else "hf,native,eagle,sam,eagle+sam"
    methods = [m.strip() for m in (default if args.methods is None else args.methods).split(",") if m.strip()]
    if not methods and args.concurrency:
        return _concurrency_only(args)
    unknown = set(methods) - set(METHODS)
    if unknown or "hf" not in methods:
        raise InvalidRequest(f"--methods must include hf and only {','.join(METHODS)}; got {args.methods!r}")
    if args.chart and importlib.util.find_spec("matplotlib") is None:  # before the long run, not after
        raise InvalidRequest("--chart needs matplotlib: pip install 'aerie[bench]'")
    if "pipeline" in methods and not args.coordinator:
        raise InvalidRequest("method 'pipeline' needs --coordinator HOST:PORT (start one with `aerie up`)")
    tree = tree_params(args)
    local = build_local_engine(args.target, args.draft, dtype(args), tree, args.draft_vocab, args.draft_dtype,
                               recalibrate=args.recalibrate, device=device(args))
    if local.engine.drafter is None and ({"eagle", "eagle+sam"} & set(methods) or args.sweep):
        raise InvalidRequest("methods 'eagle' and 'eagle+sam' need a draft head: pass --draft DIR")
    prompts = load_prompts(args.prompts, local.tokenizer, args.limit, args.per_category, categories(args))
    engine = local.engine
    e = engine
    plain = e.plain()
    with_chain = replace(e.budget, chain_limit=CHAIN_LIMIT)
    retrieval = {
        "sam": Engine(e.verifier, None, e.max_context, e.vocab_size, e.eos_token_ids, with_chain, retrieval=True),
        "eagle+sam": Engine(e.verifier, e.drafter, e.max_context, e.vocab_size, e.eos_token_ids, with_chain,
                            retrieval=True),
    }
    if "eagle+ahead" in methods:  # the same EAGLE engine drafting the next tree ahead (a drafter thread)
        from services.spec.overlap import AheadPolicy

        if e.drafter is None:
            raise InvalidRequest("method 'eagle+ahead' needs a draft head: pass --draft DIR")
        retrieval["eagle+ahead"] = Engine(e.verifier, e.drafter, e.max_context, e.vocab_size, e.eos_token_ids,
                                          e.budget, ahead=AheadPolicy())
    hf = HFBaseline(local.model_dir, DTYPES[dtype(args)], engine.eos_token_ids, device(args))
    # warm up every path once (first-call allocations and kernel selection)
    hf.run(prompts[0], 4)
    run_engine(plain, prompts[0], 4)
    if engine.drafter:
        run_engine(engine, prompts[0], 4)
    for m, eng in retrieval.items():
        if m in methods:
            run_engine(eng, prompts[0], 4)
    if "pipeline" in methods:  # the services' first sequence too (their first-call allocations)
        _pipeline_run(args, prompts[0], 4)

    # sweep: fixed shapes through the same cost model (predictions), and the auto budget itself
    shapes = [TreeParams(k, d, n) for n, d, k in SWEEP] + [None] if args.sweep else \
        ([tree] if "eagle" in methods else [])
    sweep_engines = {}
    for shape in shapes:
        budget = e.budget if shape is None else replace(e.budget, largest=shape, fixed=shape)
        drafter = e.drafter
        if shape is not None and not drafter.tree.covers(shape):
            from services.engine.drafter import Drafter
            drafter = Drafter(drafter.head, shape)
        sweep_engines[_eagle_name(shape, args.sweep)] = Engine(e.verifier, drafter, e.max_context, e.vocab_size,
                                                               e.eos_token_ids, budget)
    runs: dict[str, list] = {m: [] for m in methods if m != "eagle"}
    for name in sweep_engines:
        runs[name] = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        # interleave methods per prompt so machine noise hits all of them alike
        runs["hf"].append(hf.run(prompt, args.max_new_tokens))
        if "native" in runs:
            runs["native"].append(run_engine(plain, prompt, args.max_new_tokens))
        for name, eng in sweep_engines.items():
            runs[name].append(run_engine(eng, prompt, args.max_new_tokens))
        for m, eng in retrieval.items():
            if m in runs:
                runs[m].append(run_engine(eng, prompt, args.max_new_tokens))
        if "pipeline" in runs:
            runs["pipeline"].append(_pipeline_run(args, prompt))
        print(f"[{i + 1}/{len(prompts)}] {prompt.category} {time.perf_counter() - t0:.0f}s", flush=True)
    result = summarize(runs, prompts)
    result["config"] = {"target": local.target_path, "draft": local.draft_path, "dtype": dtype(args),
                        "device": device(args), "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
                        "limit": args.limit, "per_category": args.per_category, "categories": list(categories(args)),
                        "torch_threads": __import__("torch").get_num_threads(),
                        "tree": "auto" if tree is None else [tree.size, tree.depth, tree.top_k],
                        "cost_model": e.budget.costs.to_dict()}
    if args.sweep:
        eagle_rows = {m: r for m, r in result["methods"].items() if m.startswith("eagle")}
        best = max(eagle_rows, key=lambda m: eagle_rows[m]["tokens_per_s"])
        result["best_tree"] = best
    if args.tp_verify > 1:
        from services.bench.tp_verify import tp_table, tp_verify_latency

        result["tp_verify"] = tp_verify_latency(local.model_dir, dtype(args), device(args), args.tp_verify)
    print(table(result))
    if "tp_verify" in result:
        print(tp_table(result["tp_verify"]))
    if args.sweep:
        print(f"best tree: {result['best_tree']}")
    if args.concurrency:
        from aerie_cli.bench_concurrency import run_concurrency

        result.update(run_concurrency(args, prompts))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if args.chart:
        chart(result, args.chart, f"aerie bench ({dtype(args)}, {len(prompts)} prompts)")
        if args.concurrency:
            _concurrency_chart(args, result)
    return 0


def categories(args: argparse.Namespace) -> tuple[str, ...]:
    """--categories as a tuple (empty: every category)."""
    return tuple(c.strip() for c in (args.categories or "").split(",") if c.strip())


def _concurrency_only(args: argparse.Namespace) -> int:
    """`--concurrency` without --methods: only the sweep through the services."""
    import torch

    from aerie_cli.bench_concurrency import run_concurrency
    from services.bench.bench import load_prompts
    from services.engine.local import build_local_engine

    tokenizer = build_local_engine(args.target, "none", dtype(args)).tokenizer  # the target's own
    prompts = load_prompts(args.prompts, tokenizer, args.limit, args.per_category, categories(args))
    result = {"config": {"target": args.target, "draft": args.draft, "dtype": dtype(args),
                         "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "limit": args.limit,
                         "per_category": args.per_category, "categories": list(categories(args)),
                         "torch_threads": torch.get_num_threads()}}
    result.update(run_concurrency(args, prompts))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if args.chart:
        _concurrency_chart(args, result)
    return 0


def _concurrency_chart(args: argparse.Namespace, result: dict) -> None:
    """The concurrency chart: --chart itself when only the sweep ran, else <chart>-concurrency.png."""
    from services.bench.concurrency import chart as conc_chart

    path = args.chart if "methods" not in result else args.chart.removesuffix(".png") + "-concurrency.png"
    steady = {(d["method"], d["concurrency"]): d["steady_tokens_per_s"] for d in result["concurrency_decode"]}
    conc_chart(result["concurrency"], path,
               f"aerie bench --concurrency ({dtype(args)}, {result['concurrency_config']['max_new_tokens']} tokens/seq)",
               steady)


def _eagle_name(shape, sweep: bool) -> str:
    if not sweep:
        return "eagle"
    return "eagle-auto" if shape is None else f"eagle{shape.size}/{shape.depth}/{shape.top_k}"


def _pipeline_run(args, prompt, max_new_tokens: int | None = None):
    from services.bench.bench import run_steps
    from services.engine.engine import GenerationRequest
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession

    req = GenerationRequest(prompt.ids, max_new_tokens or args.max_new_tokens)
    session = RemoteSession(args.coordinator, None, "", None)
    try:
        return run_steps(lambda: RemoteEngine(session).generate(req))
    finally:
        session.close()


def _shape_bench(args: argparse.Namespace) -> int:
    """`--shape`: the model-free device benchmark (table + JSON)."""
    from services.bench.gpu import SHAPES, GpuBenchConfig, run_gpu_bench, table

    if args.shape not in SHAPES:
        raise InvalidRequest(f"--shape must be one of {', '.join(SHAPES)}; got {args.shape!r}")
    dev = device(args)
    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    except ValueError:
        raise InvalidRequest(f"--batches must be a comma list of integers; got {args.batches!r}") from None
    if not batches or min(batches) < 1 or args.prompt_tokens < 1 or args.max_new_tokens < 1:
        raise InvalidRequest("--batches, --prompt-tokens and --max-new-tokens must be >= 1")
    dtype_name = args.dtype or ("bf16" if dev.startswith("cuda") else "fp32")
    if args.pipeline:
        return _pipeline_shape_bench(args, dev, dtype_name)
    if args.pipelines is not None or args.interleave:
        raise InvalidRequest("--pipelines and --interleave are --pipeline's: give it too")
    cfg = GpuBenchConfig(args.shape, dev, dtype_name, args.prompt_tokens, args.max_new_tokens, batches, hf=not args.no_hf,
                         legacy=not args.no_legacy, paged=args.paged_attention)
    def write(res: dict) -> None:  # after each group of measurements: a run cut short keeps what it measured
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(res, f, indent=2)

    res = run_gpu_bench(cfg, checkpoint=write)
    print(table(res))
    return 0


def _pipeline_shape_bench(args: argparse.Namespace, dev: str, dtype_name: str) -> int:
    """`--shape S --pipeline`: the pipeline against the in-process engine on a random checkpoint."""
    from services.bench.pipeline_shape import (DEFAULT_PIPELINES, PIPELINES, PipelineBenchConfig,
                                               run_pipeline_bench, table)

    if args.repeats < 1:
        raise InvalidRequest(f"--repeats must be >= 1; got {args.repeats}")
    if args.profile:
        from services.bench.service_profile import find_py_spy

        find_py_spy()  # (before minutes of checkpoint and start-up)
    pipelines = DEFAULT_PIPELINES
    if args.pipelines is not None:
        pipelines = tuple(name.strip() for name in args.pipelines.split(",") if name.strip())
        unknown = [name for name in pipelines if name not in PIPELINES]
        if unknown or not pipelines:
            raise InvalidRequest(f"--pipelines must name some of {', '.join(PIPELINES)}; got {args.pipelines!r}")
    res = run_pipeline_bench(PipelineBenchConfig(args.shape, dev, dtype_name, args.prompt_tokens,
                                                 args.max_new_tokens, args.repeats, pipelines=pipelines,
                                                 interleave=args.interleave, profile=args.profile))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    print(table(res))
    return 0
