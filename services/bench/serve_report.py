"""Render `aerie bench serve` results: a table (one row per server) and a PNG chart comparing servers.

    print(table([result_a, result_b]))
    chart([result_a, result_b], "serve.png")    # title: servers, machine, threads

Each result is services/bench/serve.py's dict plus "label", "machine" and "threads" (the CLI adds them).
The chart has six panels, each on its own scale: TTFT, TPOT, ITL and E2E (mean, median, p99 in ms),
req/s and output tok/s, with the legend in its own row under the panels so that it never covers a bar.
"""

from __future__ import annotations

from pathlib import Path

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _f(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(results: list[dict]) -> str:
    cols = ["server", "ok/fail", "req/s", "out tok/s"] + [f"{n} {s}" for _, n in LATENCIES
                                                          for s in ("mean", "med", "p99")] + ["accept", "acc len"]
    head = f"{cols[0]:<14}{cols[1]:>9}" + "".join(f"{c:>11}" for c in cols[2:])
    lines = [head, "-" * len(head)]
    for r in results:
        acc = r.get("acceptance") or {}
        cells = [_f(r["request_throughput"], "{:.2f}"), _f(r["output_throughput"], "{:.1f}")]
        for key, _ in LATENCIES:
            cells += [_f(r[key][s], "{:.1f}") for s in ("mean", "median", "p99")]
        cells += [_f(acc.get("acceptance_rate"), "{:.0%}"), _f(acc.get("mean_accept_length"), "{:.2f}")]
        lines.append(f"{r.get('label', 'server'):<14}{r['completed']:>5}/{r['failed']:<3}" +
                     "".join(f"{c:>11}" for c in cells))
    lines.append("latencies in ms; accept = accepted / draft tokens, acc len = tokens per round (server /metrics)")
    return "\n".join(lines)


def title(results: list[dict]) -> str:
    c = results[0]["config"]
    rate = "all at once" if c["request_rate"] == "inf" else f"{c['request_rate']} req/s"
    conc = f", concurrency {c['max_concurrency']}" if c["max_concurrency"] else ""
    machines = sorted({f"{r.get('machine', '?')}, server threads: {r.get('threads', '?')}" for r in results})
    return (f"aerie bench serve: {', '.join(r.get('label', 'server') for r in results)} - {c['num_prompts']} "
            f"requests, {rate}{conc}, {c['max_tokens']} tokens\n" + "; ".join(machines))


def chart(results: list[dict], path: str | Path):
    """Write the PNG; returns (legend, *axes) window extents, for layout checks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.get("label", "server") for r in results]
    fig, grid = plt.subplots(2, 3, figsize=(12, 7))
    axes = list(grid.flat)
    width = 0.8 / len(results)
    stats = ("mean", "median", "p99")
    for ax, (key, name) in zip(axes, LATENCIES):  # one panel per latency: each its own scale
        for j, r in enumerate(results):
            ax.bar([i + j * width for i in range(len(stats))], [r[key][s] or 0 for s in stats], width,
                   label=labels[j], color=f"C{j}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(stats))], stats)
        ax.set_title(f"{name} (ms)")
    for ax, key, name in ((axes[4], "request_throughput", "requests / s"), (axes[5], "output_throughput",
                                                                             "output tokens / s")):
        for j, r in enumerate(results):
            ax.bar(j, r[key] or 0, 0.8, color=f"C{j}")
        ax.set_xticks([])
        ax.set_title(name)
    fig.suptitle(title(results), fontsize=10)
    handles, names = axes[0].get_legend_handles_labels()
    legend = fig.legend(handles, names, loc="lower center", ncol=len(results), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # the bottom 6% holds the legend, outside every panel
    fig.savefig(path, dpi=110)
    fig.canvas.draw()
    boxes = (legend.get_window_extent(), *(ax.get_window_extent() for ax in axes))
    plt.close(fig)
    return boxes
