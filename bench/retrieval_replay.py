"""Replay retrieval drafts against the target's own greedy answers: how many retrieved tokens each
rule could get accepted, and what that is worth at a measured verify cost, without timing a model.

    AERIE_TORCH_THREADS=1 python bench/retrieval_replay.py --prompts ../shared/data/spec_bench_dev.jsonl \
        --per-category 4 --max-new-tokens 128 --categories summarization,rag,translation,math_reasoning,qa \
        --costs-from bench/results/bench-cpu-head2.json --json bench/results/retrieval-replay.json

Greedy decoding is deterministic, so the answer (aerie's plain decoding, computed once here or read
from --refs) fixes what any retrieved chain would have accepted: the longest prefix of the chain
equal to the answer's next tokens. Per category, over the first `--max-new-tokens` of each answer
(--cut to also report shorter prefixes):
  budget   the engine's rule: services.spec.sam.SuffixIndex's chain, chain length chosen by the real
           Budget.plan from its running statistics (updated by the real `observe`), probes included
  oracle   the same chain, verifying exactly the tokens it would get accepted (none on a miss): the
           most this retrieval source can give at this verify cost
  oracle-trie-K   up to K chains from different earlier occurrences of the text's suffix (longest
           match first, then most recent), joined as a trie, the accepted branch verified alone:
           the most a K-candidate retrieval tree could add
Decode speed-up = committed tokens / verify cost in plain-step units (t_verify(rows) / t_verify(1),
the cost curve of --costs-from, a bench JSON's config.cost_model); draft time is ~0 for retrieval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.spec.acceptance import observe, prior_stats  # noqa: E402
from services.spec.budget import Budget  # noqa: E402
from services.spec.cost import CostCurve, CostModel  # noqa: E402
from services.spec.sam import SuffixIndex  # noqa: E402
from services.spec.tree import merge_chain, root_tree  # noqa: E402

LIMIT = 16  # the engine's CHAIN_LIMIT


def answers(args) -> list[dict]:
    if args.refs and Path(args.refs).exists():
        return json.loads(Path(args.refs).read_text())
    from services.bench.bench import load_prompts, run_engine
    from services.engine.local import build_local_engine

    local = build_local_engine(None, "none")
    out = []
    cats = set(args.categories.split(","))
    for p in load_prompts(args.prompts, local.tokenizer, 0, args.per_category):
        if p.category in cats:
            r = run_engine(local.engine, p, args.max_new_tokens)
            out.append({"cat": p.category, "ids": list(p.ids), "out": r.tokens})
            print(p.category, len(p.ids), len(r.tokens), flush=True)
    if args.refs:
        Path(args.refs).write_text(json.dumps(out))
    return out


def accepted(chain: list[int], future: list[int]) -> int:
    k = 0
    while k < len(chain) and k < len(future) and chain[k] == future[k]:
        k += 1
    return k


def candidates(text: list[int], width: int, limit: int = LIMIT, max_match: int = 32) -> list[list[int]]:
    """Up to `width` distinct continuations of earlier occurrences of the text's suffix (>= 2 tokens),
    longest match first, then the most recent."""
    n, occ = len(text), []
    for e in range(n - 2, -1, -1):
        length = 0
        while length < max_match and e - length >= 0 and text[e - length] == text[n - 1 - length]:
            length += 1
        if length >= 2 and e + 1 < n:
            occ.append((length, e))
    occ.sort(key=lambda x: (-x[0], -x[1]))
    out: list[list[int]] = []
    for _, e in occ:
        c = text[e + 1: e + 1 + limit]
        if c not in out:
            out.append(c)
        if len(out) >= width:
            break
    return out


def replay(prompt: list[int], answer: list[int], rule: str, budget: Budget | None, tv) -> tuple[int, int, float]:
    """(committed tokens after the first, rounds, verify cost in plain steps) over `answer`."""
    stats = budget.new_stats() if rule == "budget" else None
    index = SuffixIndex()
    index.extend(prompt + answer[:1])
    i = tokens = rounds = 0
    cost = 0.0
    while i < len(answer) - 1:
        future = answer[i + 1:]
        if rule == "budget":
            chain = index.propose(LIMIT)
            plan = budget.plan(stats, len(chain))
            chain = chain[: plan.chain]
            k = accepted(chain, future)
            tree, nodes = merge_chain(root_tree(answer[i]), chain, False)
            observe(stats, tree, [0] + nodes[:k], nodes, 1)
            rows = 1 + len(chain)
        elif rule == "oracle":
            k = accepted(index.propose(LIMIT), future)
            rows = 1 + k
        else:  # oracle-trie-K
            k = max((accepted(c, future) for c in candidates(prompt + answer[: i + 1], int(rule.rsplit("-", 1)[1]))),
                    default=0)
            rows = 1 + k
        cost += tv(rows) / tv(1)
        rounds += 1
        tokens += k + 1
        index.extend(answer[i + 1: i + k + 2])
        i += k + 1
    return tokens, rounds, cost


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cut", default="48", help="also report the first N tokens of each answer (comma list)")
    p.add_argument("--categories", default="summarization,rag,translation,math_reasoning,qa")
    p.add_argument("--costs-from", required=True, help="a bench JSON whose config.cost_model is used")
    p.add_argument("--refs", default=None, help="cache of the greedy answers (read if present, else written)")
    p.add_argument("--rules", default="budget,oracle,oracle-trie-2,oracle-trie-4")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    costs = CostModel.from_dict(json.loads(Path(args.costs_from).read_text())["config"]["cost_model"])
    tv = CostCurve(costs.verify.rows, costs.verify.seconds)
    budget = Budget(costs, prior_stats(), eagle=False)
    refs = answers(args)
    result: dict = {"config": vars(args), "verify_ratio": [round(s / tv(1), 3) for s in tv.seconds], "rows": []}
    for n in sorted({args.max_new_tokens, *(int(x) for x in args.cut.split(",") if x)}):
        for cat in args.categories.split(","):
            rs = [r for r in refs if r["cat"] == cat]
            if not rs:
                continue
            for rule in args.rules.split(","):
                tok = rnd = 0
                cost = 0.0
                for r in rs:
                    t, k, c = replay(r["ids"], r["out"][:n], rule, budget, tv)
                    tok, rnd, cost = tok + t, rnd + k, cost + c
                row = {"tokens": n, "category": cat, "rule": rule, "answers": len(rs),
                       "tau": round(tok / rnd, 3) if rnd else None,
                       "decode_speedup": round(tok / cost, 3) if cost else None}
                result["rows"].append(row)
                print(f"{n:>4} {cat:<16}{rule:<16} tau {row['tau']}  decode speed-up {row['decode_speedup']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
