"""Throughput and latency under concurrency: N sequences generate at once (through the services'
continuous batching), for plain decoding, a fixed tree and the load-adaptive budget.

    stream = SequenceTimes()            # per sequence: when each streamed message with tokens arrived
    level = run_level(start_fns)        # N threads, each generating one sequence -> LevelRun
    row = summarize_level("plain", N, level)
        -> {"method", "concurrency", "tokens_per_s", "itl_p50_ms", "itl_p99_ms"}

Aggregate tokens/s = every sequence's output tokens / wall time from the first start to the last
end. Inter-token latency (ITL): the time between consecutive streamed messages of a sequence divided
by the tokens the later message carries, one sample per token (a round that commits 3 tokens after
90 ms gives three 30 ms samples), so plain decoding and speculation are measured alike; the
prefill's first message is not an ITL sample. The steady decode rate (`steady_tokens_per_s`, in the
detail) leaves the prefills out: tokens per second while every sequence is decoding. It does not
start services or print: the CLI does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from services.engine.engine import RoundOutput


@dataclass(slots=True)
class SequenceTimes:
    start: float = 0.0
    end: float = 0.0
    tokens: int = 0
    itl: list[float] = field(default_factory=list)  # seconds per token
    tree_nodes: list[int] = field(default_factory=list)  # nodes verified per round (1 = plain step)
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of each message


@dataclass(slots=True)
class LevelRun:
    sequences: list[SequenceTimes]
    errors: list[str]


def time_stream(steps: Iterator[RoundOutput]) -> SequenceTimes:
    out = SequenceTimes(start=time.perf_counter())
    last = None
    for step in steps:
        now = time.perf_counter()
        n = len(step.tokens)
        if n and last is not None:
            out.itl += [(now - last) / n] * n
        if step.stats.round_index > 0:
            out.tree_nodes.append(max(step.stats.tree_size, 1))
        if n:
            last = now
            out.events.append((now, n))
        out.tokens += n
    out.end = time.perf_counter()
    return out


def run_level(starts: list[Callable[[], Iterator[RoundOutput]]]) -> LevelRun:
    """Run every `starts[i]()` stream in its own thread, all released together."""
    results: list[SequenceTimes | None] = [None] * len(starts)
    errors: list[str] = []
    go = threading.Barrier(len(starts))

    def worker(i: int) -> None:
        go.wait()
        try:
            results[i] = time_stream(starts[i]())
        except Exception as e:  # noqa: BLE001 (reported with the level)
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(starts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return LevelRun([r for r in results if r is not None], errors)


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used so far; None where /proc cannot tell."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_token(before: dict[str, float], after: dict[str, float], run: LevelRun) -> dict[str, float]:
    """Role -> CPU milliseconds its process spent per output token of the level (every process,
    the idle ones too: a level's cost is all of it). Example: 0.9 s over 48 tokens -> 18.75."""
    tokens = sum(s.tokens for s in run.sequences)
    if not tokens:
        return {}
    return {role: round(1000 * (after[role] - before[role]) / tokens, 2) for role in after if role in before}


def batch_totals(metrics_text: str, service: str) -> dict[str, float]:
    """{"forwards", "calls", "rows"} so far from a service's Prometheus text (aerie_batch_size and
    aerie_batch_rows histograms of `service`)."""
    want = {f'aerie_batch_size_count{{service="{service}"}}': "forwards",
            f'aerie_batch_size_sum{{service="{service}"}}': "calls",
            f'aerie_batch_rows_sum{{service="{service}"}}': "rows"}
    return prometheus_samples(metrics_text, want)


def prometheus_samples(metrics_text: str, want: dict[str, str]) -> dict[str, float]:
    """{want[sample]: value} for each sample line (`name{labels} value`) of Prometheus text whose
    `name{labels}` is a key of `want` (absent samples are left out)."""
    out = {}
    for line in metrics_text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


def metric_delta(before: str, after: str, sample: str) -> float:
    """How much one sample line (`name{labels}`) of Prometheus text grew between two scrapes (0 when
    absent: a counter never incremented is not exported)."""
    def value(text: str) -> float:
        return prometheus_samples(text, {sample: "v"}).get("v", 0.0)

    return value(after) - value(before)


ROUND_PARTS = ("round", "draft", "verify", "commit")  # the coordinator's aerie_<part>_seconds histograms


def round_totals(metrics_text: str, service: str = "coordinator") -> dict[str, float]:
    """{"<part>_sum", "<part>_count"} so far for each of ROUND_PARTS from a coordinator's Prometheus
    text (the per-round latencies its engine measures: drafting, the verify call with its wait in
    the verifier's batch, the Redis commit, and their sum)."""
    want = {}
    for part in ROUND_PARTS:
        for kind in ("sum", "count"):
            want[f'aerie_{part}_seconds_{kind}{{service="{service}"}}'] = f"{part}_{kind}"
    return prometheus_samples(metrics_text, want)


def round_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per round of each part between two `round_totals` (the draft over the
    rounds that drafted; verify, commit and round over every decode round). Example: verify sums
    1.0 -> 2.5 s over 30 more rounds -> {"verify": 50.0, ...}."""
    out = {}
    for part in ROUND_PARTS:
        n = after.get(f"{part}_count", 0.0) - before.get(f"{part}_count", 0.0)
        s = after.get(f"{part}_sum", 0.0) - before.get(f"{part}_sum", 0.0)
        if n > 0:
            out[part] = round(1000 * s / n, 2)
            out[f"{part}_rounds"] = int(n)
    return out


def forward_shape(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The forwards run between two `batch_totals`: count, calls and rows per forward ({} unknown)."""
    if not before or not after or set(before) != set(after):
        return {}
    d = {k: after[k] - before[k] for k in after}
    if d["forwards"] <= 0:
        return {"forwards": 0}
    return {"forwards": int(d["forwards"]), "calls_per_forward": round(d["calls"] / d["forwards"], 2),
            "rows_per_forward": round(d["rows"] / d["forwards"], 1)}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]. percentile([1, 2, 3, 4], 50) = 2.5."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize_level(method: str, concurrency: int, run: LevelRun) -> dict:
    seqs = run.sequences
    wall = max(s.end for s in seqs) - min(s.start for s in seqs) if seqs else 0.0
    tokens = sum(s.tokens for s in seqs)
    itl = [x for s in seqs for x in s.itl]
    return {"method": method, "concurrency": concurrency,
            "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
            "itl_p50_ms": round(1000 * percentile(itl, 50), 2),
            "itl_p99_ms": round(1000 * percentile(itl, 99), 2)}


def steady_tokens_per_s(seqs: list[SequenceTimes]) -> float:
    """Decode throughput while every sequence is decoding: the tokens that arrive after the last
    sequence got its first token (every prefill done) and up to the first sequence's last message,
    over that window. 0 when the window is empty."""
    if not seqs or any(not s.events for s in seqs):
        return 0.0
    lo = max(s.events[0][0] for s in seqs)
    hi = min(s.events[-1][0] for s in seqs)
    if hi <= lo:
        return 0.0
    tokens = sum(n for s in seqs for t, n in s.events if lo < t <= hi)
    return round(tokens / (hi - lo), 3)


def level_detail(run: LevelRun) -> dict:
    """What the summary row leaves out: the steady decode rate (no prefill), tokens, wall seconds,
    mean nodes per round, errors."""
    seqs = run.sequences
    nodes = [n for s in seqs for n in s.tree_nodes]
    return {"steady_tokens_per_s": steady_tokens_per_s(seqs), "tokens": sum(s.tokens for s in seqs),
            "wall_s": round(max(s.end for s in seqs) - min(s.start for s in seqs), 3) if seqs else 0.0,
            "mean_nodes": round(sum(nodes) / len(nodes), 2) if nodes else 0.0,
            "plain_rounds": round(sum(n == 1 for n in nodes) / len(nodes), 3) if nodes else 0.0,
            "errors": run.errors}


def crossover(rows: list[dict], a: str = "tree", b: str = "plain") -> int | None:
    """The smallest concurrency from which method `a` stays below `b` in tokens/s (None: never)."""
    by = {(r["method"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    found = None
    for n in reversed(levels):
        if (a, n) in by and (b, n) in by and by[(a, n)] < by[(b, n)]:
            found = n
        else:
            break
    return found


def table(rows: list[dict], steady: dict | None = None) -> str:
    """`steady`: (method, N) -> the steady decode tok/s (a column when given)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["method"], r["concurrency"]): r for r in rows}
    steady = steady or {}
    head = (f"{'method':<10}{'N':>4}{'tok/s':>10}{'x N=1':>8}{'ITL p50 ms':>12}{'ITL p99 ms':>12}"
            f"{'decode tok/s':>14}")
    lines = [head, "-" * len(head)]
    for m in methods:
        base = by.get((m, levels[0]), {}).get("tokens_per_s") or 0
        for n in levels:
            r = by.get((m, n))
            if r is None:
                continue
            scale = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
            dec = steady.get((m, n))
            lines.append(f"{m:<10}{n:>4}{r['tokens_per_s']:>10.2f}{scale:>8}{r['itl_p50_ms']:>12.1f}"
                         f"{r['itl_p99_ms']:>12.1f}" + (f"{dec:>14.2f}" if dec is not None else f"{'-':>14}"))
    return "\n".join(lines)


def chart(rows: list[dict], path: str, title: str, steady: dict | None = None) -> None:
    """Panels against concurrency, one line per method: aggregate tokens/s, p50 ITL, and (given
    `steady`: (method, N) -> tok/s) the steady decode rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 3 if steady else 2, figsize=(15 if steady else 10, 4))
    for m in methods:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        axes[0].plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=m)
        axes[1].plot(xs, [r["itl_p50_ms"] for r in rs], marker="o", label=m)
        if steady:
            axes[2].plot(xs, [steady.get((m, x), 0.0) for x in xs], marker="o", label=m)
    labels = ["aggregate tokens / s (prefill included)", "ITL p50 (ms / token)", "decode tokens / s (all decoding)"]
    for ax, label in zip(axes, labels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sequences")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
