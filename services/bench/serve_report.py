"""Render `aerie bench serve` results: a table (one row per server) and a PNG chart comparing servers.

    print(table([result_a, result_b]))
    chart([result_a, result_b], "serve.png")    # title: servers, machine, threads

Each result is services/bench/serve.py's dict plus "label", "machine" and "threads" (the CLI adds them).
The chart has three panels, latencies (TTFT, TPOT, ITL, E2E: mean and p99, ms), req/s and output
tok/s, with the legend in its own row under the panels so that it never covers a bar.
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
    machines = sorted({f"{r.get('machine', '?')}, {r.get('threads', '?')} threads" for r in results})
    return (f"aerie bench serve: {', '.join(r.get('label', 'server') for r in results)} - {c['num_prompts']} "
            f"requests, {rate}{conc}, {c['max_tokens']} tokens\n" + "; ".join(machines))


def chart(results: list[dict], path: str | Path):
    """Write the PNG; returns the figure's legend and axes (closed figure) for layout checks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.get("label", "server") for r in results]
    fig, (lat, req, tok) = plt.subplots(1, 3, figsize=(13, 5), gridspec_kw={"width_ratios": [4, 1, 1]})
    width = 0.8 / len(results)
    groups = [f"{name} {s}" for _, name in LATENCIES for s in ("mean", "p99")]
    for j, r in enumerate(results):
        ys = [r[key][s] or 0 for key, _ in LATENCIES for s in ("mean", "p99")]
        lat.bar([i + j * width for i in range(len(groups))], ys, width, label=labels[j], color=f"C{j}")
        req.bar(j, r["request_throughput"] or 0, 0.8, color=f"C{j}")
        tok.bar(j, r["output_throughput"] or 0, 0.8, color=f"C{j}")
    lat.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=30, ha="right")
    lat.set_ylabel("ms")
    lat.set_title("latency per request (TPOT, ITL: per output token / chunk)")
    for ax, name in ((req, "requests / s"), (tok, "output tokens / s")):
        ax.set_xticks([])
        ax.set_title(name)
    fig.suptitle(title(results), fontsize=10)
    handles, names = lat.get_legend_handles_labels()
    legend = fig.legend(handles, names, loc="lower center", ncol=len(results), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the bottom 8% holds the legend, outside both panels
    fig.savefig(path, dpi=110)
    fig.canvas.draw()
    boxes = (legend.get_window_extent(), lat.get_window_extent(), req.get_window_extent(), tok.get_window_extent())
    plt.close(fig)
    return boxes
