"""τ with the cost-model budget: how many tokens a head makes each target forward commit when aerie's
engine serves it (issue 10's report), next to aerie's plain decoding on the same prompts.

    python -m services.train.tau --head DIR --prompts FILE [--per-category 1] [--max-new-tokens 48] [--write]

Greedy, batch 1, in process, the auto budget (the cost model calibrated on this device, the head's
report as its prior), fp32 target: the same engine `aerie generate` and `aerie bench` run. `--write`
adds the result to the head's report.json under "tau" (the other keys are kept). The training
pipeline calls `measure` itself when given `--tau-prompts`.

τ counts every round, the ones where the budget chose not to draft included (those commit one
token); `tau_drafted` counts only the rounds that verified a draft.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from services.errors import InvalidRequest

if TYPE_CHECKING:
    from services.spec.tree import TreeParams


def measure(head_dir: str | Path, prompts: str | Path, target: str | None = None, per_category: int = 1,
            limit: int = 0, max_new_tokens: int = 48, tree: "TreeParams | None" = None) -> dict:
    """`tree` None: the auto budget, as served; a TreeParams: that fixed shape in every round."""
    from services.bench.bench import load_prompts, run_engine, summarize
    from services.engine.local import build_local_engine

    if max_new_tokens < 1:
        raise InvalidRequest(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    local = build_local_engine(target, str(head_dir), tree=tree)
    e = local.engine
    plain = e.plain()
    ps = load_prompts(prompts, local.tokenizer, limit, per_category)
    run_engine(plain, ps[0], 4)  # first-call allocations and kernel choice, for both
    run_engine(e, ps[0], 4)
    runs: dict[str, list] = {"native": [], "eagle": []}
    for p in ps:  # interleaved, so machine noise hits both alike
        runs["native"].append(run_engine(plain, p, max_new_tokens))
        runs["eagle"].append(run_engine(e, p, max_new_tokens))
    s = summarize(runs, ps, baseline="native")

    def row(r: dict) -> dict:
        return {k: r[k] for k in ("prompts", "tau", "tau_drafted", "eagle_round_share", "vs_plain",
                                  "exact_match")}

    import torch

    return {"prompts": str(prompts), "per_category": per_category, "limit": limit,
            "max_new_tokens": max_new_tokens, "target_dtype": "fp32", "torch_threads": torch.get_num_threads(),
            "budget": "auto (cost model)" if tree is None else f"fixed {tree.size}/{tree.depth}/{tree.top_k}",
            **row(s["methods"]["eagle"]),
            "categories": {c: row(ms["eagle"]) for c, ms in s["categories"].items()}}


def write(head_dir: str | Path, tau: dict) -> dict:
    """Add `tau` to the head's report.json (created if it has none) and return the report."""
    path = Path(head_dir) / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report["tau"] = tau
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.train.tau", description=__doc__.split("\n")[0])
    p.add_argument("--head", required=True, help="head directory")
    p.add_argument("--prompts", required=True, help="Spec-Bench-style JSONL (question_id, category, turns)")
    p.add_argument("--target", default=None, help="target model (default: the default model)")
    p.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (0 = all)")
    p.add_argument("--limit", type=int, default=0, help="at most N prompts (0 = no limit)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--write", action="store_true", help="add the result to the head's report.json")
    args = p.parse_args(argv)
    if os.environ.get("AERIE_TORCH_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["AERIE_TORCH_THREADS"]))
    tau = measure(args.head, args.prompts, args.target, args.per_category, args.limit, args.max_new_tokens)
    if args.write:
        write(args.head, tau)
    print(json.dumps(tau), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
