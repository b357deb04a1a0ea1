"""Render benchmark results: a fixed-width table on stdout and a PNG bar chart (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

COLUMNS = [("tokens_per_s", "tok/s", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"), ("tau", "tau", "{:.2f}"),
           ("round_ms", "round ms", "{:.1f}"), ("draft_ms", "draft ms", "{:.1f}"),
           ("verify_ms", "verify ms", "{:.1f}"), ("other_ms", "other ms", "{:.1f}"),
           ("exact_match", "exact", "{:.0%}"), ("mean_tree", "nodes", "{:.1f}"),
           ("predicted_tokens_per_s", "pred tok/s", "{:.2f}"), ("measured_round_tokens_per_s", "meas tok/s", "{:.2f}"),
           # end to end over aerie plain; then prefill excluded (decode only); retrieval per round
           ("vs_plain", "e2e/plain", "{:.2f}x"), ("prefill_share", "prefill", "{:.0%}"),
           ("decode_tokens_per_s", "dec tok/s", "{:.2f}"), ("decode_vs_plain", "dec/plain", "{:.2f}x"),
           ("chain_per_round", "chain/rd", "{:.2f}"), ("chain_accepted_per_round", "ch acc/rd", "{:.2f}"),
           ("plain_round_share", "plain rds", "{:.0%}"),
           # drafting ahead (method eagle+ahead): rounds that drafted ahead, guesses that hit, time saved
           ("ahead_share", "ahead rds", "{:.0%}"), ("guess_hit_rate", "guess hit", "{:.0%}"),
           ("saved_share", "saved", "{:.0%}")]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def table(result: dict) -> str:
    head = f"{'category':<16}{'method':<16}" + "".join(f"{label:>11}" for _, label, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    groups = [("ALL", result["methods"])] + list(result["categories"].items())
    for cat, rows in groups:
        for method, row in rows.items():
            lines.append(f"{cat:<16}{method:<16}" + "".join(f"{_cell(row, k, f):>11}" for k, _, f in COLUMNS))
    return "\n".join(lines)


def chart(result: dict, path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ["ALL"] + list(result["categories"])
    methods = list(result["methods"])
    rows = {"ALL": result["methods"], **result["categories"]}
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cats)), 4))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs = [i + j * width for i in range(len(cats))]
        ys = [rows[c].get(m, {}).get("tokens_per_s") or 0 for c in cats]
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
