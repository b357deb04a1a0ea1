"""Draft cost and agreement per draft vocabulary K and draft precision (docs/design.md "Cheaper rounds").

    AERIE_TORCH_THREADS=1 python bench/draft_cost.py --prompts ../shared/data/spec_bench_dev.jsonl \
        --per-category 2 --configs 0:fp32,16384:fp32,8192:fp32,4096:fp32,0:int8,8192:int8,0:bf16,8192:bf16

For each dev prompt the target's greedy answer (--max-new-tokens) is decoded once; then, teacher-
forced, each head configuration predicts every answer token from the target's features of the two
tokens before it (the head's own kind of features: the hidden state, or EAGLE-3's three taps; one
draft step, as the first level of a chain): `agree` = share of answer tokens
the head's top-1 equals (the acceptance of a 1-token draft). `step_ms` = median time of one draft
step (head forward on one row after the longest sequence's draft KV + log-softmax + top-8), interleaved over
configurations in one process; `D` = the target's plain decode step in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from services.bench.bench import load_prompts
from services.engine.local import DEFAULT_HEAD, build_local_engine
from services.engine.engine import GenerationRequest
from services.model.head_checkpoint import load_head


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", required=True)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--configs", default="0:fp32,16384:fp32,8192:fp32,4096:fp32,0:int8,8192:int8,0:bf16,8192:bf16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--head", default=str(DEFAULT_HEAD))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("AERIE_TORCH_THREADS", "1")))
    local = build_local_engine(None, "none", "fp32")
    target = local.engine.verifier.target
    prompts = load_prompts(args.prompts, local.tokenizer, per_category=args.per_category)
    seqs = []
    for pr in prompts:
        out = [t for s in local.engine.generate(GenerationRequest(pr.ids, args.max_new_tokens, ignore_eos=True))
               for t in s.tokens]
        seqs.append((torch.tensor(pr.ids + tuple(out)), len(pr.ids)))
    configs = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.configs.split(",")]
    heads = {c: load_head(args.head, target, draft_vocab=c[0], draft_dtype=c[1]) for c in configs}
    taps = next(iter(heads.values())).feature_kind == "taps"  # EAGLE-3: the three taps, else the hidden state
    feats = []
    for ids, plen in seqs:
        o = target(ids, target.new_cache(len(ids)), want_taps=taps)
        feats.append(o.taps if taps else o.hidden)
    result = {}
    for c, head in heads.items():
        hit = tot = 0
        for (ids, plen), f in zip(seqs, feats):
            with torch.no_grad():
                out = head(f[:-1], ids[1:], head.new_cache(len(ids)))
                pred = head.to_target(head.log_probs(out).argmax(-1))  # row i predicts ids[i + 2]
            rows = torch.arange(plen - 2, len(ids) - 2)
            hit += int((pred[rows] == ids[rows + 2]).sum())
            tot += len(rows)
        result[f"{c[0]}:{c[1]}"] = {"agree": hit / tot, "answer_tokens": tot}
    # timing: one draft step after a 160-row KV, interleaved, plus the target decode step
    i = max(range(len(seqs)), key=lambda j: len(seqs[j][0]))
    ids, f0 = seqs[i][0], feats[i]
    n = len(ids) - 2  # draft KV rows before the timed step
    caches = {}
    for c, head in heads.items():
        caches[c] = head.new_cache(n + 4)
        head(f0[:n], ids[1:n + 1], caches[c])
    tcache = target.new_cache(n + 4)
    target(ids[:n], tcache, logits_for="last")
    x_feat, x_id = f0[n:n + 1], ids[n + 1:n + 2]
    times = {c: [] for c in heads} | {"D": []}
    for _ in range(args.rounds):
        for c, head in heads.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                o = head(x_feat, x_id, caches[c])
                torch.topk(head.log_probs(o), 8, dim=-1)
            times[c].append(time.perf_counter() - t0)
            caches[c].truncate(n)
        t0 = time.perf_counter()
        target(ids[n:n + 1], tcache, logits_for="last")
        times["D"].append(time.perf_counter() - t0)
        tcache.truncate(n)
    d = statistics.median(times["D"]) * 1e3
    print(f"target decode step D = {d:.1f} ms; {len(seqs)} prompts, {result[next(iter(result))]['answer_tokens']} answer tokens")
    print(f"{'K:dtype':>12} {'step ms':>8} {'step/D':>7} {'agree':>6}")
    for c in heads:
        ms = statistics.median(times[c]) * 1e3
        r = result[f"{c[0]}:{c[1]}"]
        r.update(step_ms=ms, step_over_D=ms / d)
        print(f"{c[0]:>6}:{c[1]:<5} {ms:8.2f} {ms / d:7.3f} {r['agree']:6.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"threads": torch.get_num_threads(), "D_ms": d, "configs": result}, fh, indent=1)


if __name__ == "__main__":
    main()
