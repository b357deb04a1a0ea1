"""`aerie bench serve`: a serving benchmark against any OpenAI-compatible server, so the same command
measures aerie, vLLM or SGLang where they run.

    aerie serve HuggingFaceTB/SmolLM2-135M-Instruct &            # or vllm serve / python -m sglang.launch_server
    aerie bench serve --base-url http://127.0.0.1:8000 --max-concurrency 4 --label aerie --json-out aerie.json
    aerie bench serve --base-url http://127.0.0.1:8001 --label vllm --json-out vllm.json \\
        --compare aerie.json --chart serve.png                  # one table and chart for both servers

Streams --num-prompts chat requests (the shipped prompt set, services/bench/prompts/serve.jsonl, or
--prompts FILE) at --request-rate (Poisson; default all at once) with at most --max-concurrency in
flight, and reports req/s, output tok/s, TTFT / TPOT / ITL / E2E mean, median and p99, and the
server's speculative acceptance from its /metrics (aerie's or vLLM's counters). The definitions are
in services/bench/serve.py and docs/cli.md. It loads no model: the server does the work.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from aerie_cli.flags import HelpFormatter
from services.errors import InvalidRequest


def register(modes: argparse._SubParsersAction) -> None:
    """`serve` under `aerie bench` (modes: bench's subparsers)."""
    p = modes.add_parser("serve", help="benchmark a running OpenAI-compatible server (aerie, vLLM, SGLang)",
                         description=__doc__, formatter_class=HelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL (a trailing /v1 is fine)")
    s.add_argument("--endpoint", default="/v1/chat/completions", choices=("/v1/chat/completions", "/v1/completions"),
                   help="the API called")
    s.add_argument("--model", default=None, help="the model name sent (default: the first of GET /v1/models)")
    s.add_argument("--api-key", default=None,
                   help="bearer token (default: AERIE_API_KEY, else OPENAI_API_KEY, else none)")
    s.add_argument("--metrics-url", default=None,
                   help="the server's Prometheus /metrics for acceptance; 'none' = skip (default: BASE_URL/metrics)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", default=None,
                   help="JSONL of {\"turns\": [...]} or {\"prompt\": ...} (default: the shipped 39-prompt set)")
    w.add_argument("--num-prompts", type=int, default=None, help="requests sent (default: one per prompt)")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals; inf = all at once")
    w.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int, default=None,
                   help="requests in flight at most (default: unbounded)")
    w.add_argument("--max-tokens", type=int, default=128, help="output tokens asked for per request")
    w.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so every output is --max-tokens long (aerie, vLLM and SGLang read it)")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    w.add_argument("--seed", type=int, default=0, help="arrival times and prompt order")
    w.add_argument("--extra-body", default=None, help="a JSON object merged into every request (default: none)")
    o = p.add_argument_group("output")
    o.add_argument("--label", default=None, help="the server's name in the table, JSON and chart (default: host:port)")
    o.add_argument("--threads", default=None,
                   help="the server's CPU threads, for the chart's title (default: AERIE_TORCH_THREADS, else unknown)")
    o.add_argument("--json-out", default=None, help="write the result as JSON here (default: not written)")
    o.add_argument("--compare", nargs="+", default=(), metavar="JSON",
                   help="earlier `bench serve` JSON results (other servers) to show in the same table and chart "
                        "(default: none)")
    o.add_argument("--chart", default=None, help="PNG chart path (needs matplotlib; default: no chart)")
    p.set_defaults(func=cmd_bench_serve)


def config_from_args(args: argparse.Namespace, num_prompts: int):
    from services.bench.serve import ServeBenchConfig

    extra = None
    if args.extra_body is not None:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"--extra-body must be a JSON object; got {args.extra_body!r} ({e.msg})") from None
        if not isinstance(extra, dict):
            raise InvalidRequest(f"--extra-body must be a JSON object; got {args.extra_body!r}")
    key = args.api_key or os.environ.get("AERIE_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    metrics = "" if args.metrics_url == "none" else args.metrics_url
    return ServeBenchConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                            num_prompts=args.num_prompts or num_prompts, request_rate=args.request_rate,
                            max_concurrency=args.max_concurrency, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed,
                            api_key=key, metrics_url=metrics, extra_body=extra)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import importlib.util
    from urllib.parse import urlparse

    from services.bench.serve import load_prompts, machine_name, run
    from services.bench.serve_report import chart, table

    if args.chart and importlib.util.find_spec("matplotlib") is None:
        raise InvalidRequest("--chart needs matplotlib: pip install 'aerie[bench]'")
    earlier = []
    for path in args.compare:
        try:
            earlier.append(json.loads(open(path).read()))
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidRequest(f"--compare {path}: not a bench serve JSON result ({e})") from None
    prompts = load_prompts(args.prompts)
    config = config_from_args(args, len(prompts))
    result = asyncio.run(run(config, prompts))
    result["label"] = args.label or urlparse(config.root).netloc
    result["machine"] = machine_name()
    result["threads"] = args.threads or os.environ.get("AERIE_TORCH_THREADS") or "unknown"
    print(table(earlier + [result]))
    if result["failed"]:
        print(f"{result['failed']} requests failed; first: {result['errors'][0]}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.chart:
        chart(earlier + [result], args.chart)
    return 0 if result["completed"] else 1
