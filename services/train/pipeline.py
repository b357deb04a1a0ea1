"""Train a draft head on datagen shards and report per-position agreement.

    python -m services.train.pipeline --data /work/data/head-data --dev-data /work/data/head-dev \
        --kind eagle --draft-vocab 8192 --out DIR [--init services/heads/smollm2-135m-eagle] [--resume]

1. the shards present at the first start (their names go to DIR/manifest.json, so --resume trains
   on exactly the same data and continues at the checkpoint's step); prompts split train/held-out
   by hash (datagen.is_heldout)
2. the draft vocabulary: token counts of the training split -> draft_vocab.select (frequency
   ranked); the loss is restricted to it (EAGLE-1/2: the target's lm_head rows; EAGLE-3: d2t)
3. training with training-time test (--ttt-steps unrolled draft steps), held-out evaluation every
   --eval-every steps, early stopping (--patience), the best held-out head kept
4. DIR/config.json + model.safetensors (+ token_counts.safetensors), then DIR/report.json: per draft
   position teacher-forced top-1 / top-k agreement on held-out self-distilled data and on the
   Spec-Bench dev answers (the target's greedy answers; evaluation only), data volume, time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from services.errors import InvalidRequest
from services.model.head_kind import HEAD_KINDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.train.pipeline", description=__doc__.split("\n")[0])
    add_args(p)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="datagen shard directory (training + held-out split)")
    p.add_argument("--dev-data", default=None, help="datagen shards of the Spec-Bench dev answers (evaluation only)")
    p.add_argument("--out", required=True, help="output head directory")
    p.add_argument("--target", default=None, help="target model (default: the default model)")
    p.add_argument("--kind", choices=HEAD_KINDS, default="eagle")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary for the loss (0 = full)")
    p.add_argument("--init", default=None, help="start from this head directory (same kind) instead of fresh")
    p.add_argument("--max-shards", type=int, default=0, help="use the first N shards (0 = all present)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per sample (training-time test)")
    p.add_argument("--noise", type=float, default=0.0, help="uniform feature noise width")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (resumable)")
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--heldout-samples", type=int, default=64, help="held-out samples evaluated during training")
    p.add_argument("--heldout-every", type=int, default=50, help="1 prompt in N (by hash) is held out")
    p.add_argument("--eval-depth", type=int, default=4, help="draft positions in the report")
    p.add_argument("--compare", default=None,
                   help="also evaluate this head directory (default: --init) on the same data, for the report")
    p.add_argument("--tau-prompts", default=None,
                   help="Spec-Bench-style JSONL: after training, measure tau with the cost-model budget "
                        "(services/train/tau.py) on its first --tau-per-category prompts of each category")
    p.add_argument("--tau-per-category", type=int, default=1)
    p.add_argument("--tau-tokens", type=int, default=48, help="new tokens per prompt for the tau measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")


def run(args: argparse.Namespace, log=sys.stderr) -> dict:
    from services.model import draft_vocab
    from services.model.eagle_head import HeadConfig, build_head
    from services.model.head_checkpoint import load_head, save_head
    from services.model.loading import find_default_gguf, load_target
    from services.train.distill import VocabSubset
    from services.train.shards import list_shards, load_samples, token_counts
    from services.train.trainer import TrainConfig, evaluate, train_head

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "manifest.json"
    if args.resume and manifest.is_file():
        names = json.loads(manifest.read_text())["shards"]
        shards = [Path(args.data) / n for n in names]
        missing = [str(p) for p in shards if not p.is_file()]
        if missing:
            raise InvalidRequest(f"--resume: shards of the first run are missing: {missing[:3]}")
    else:
        shards = list_shards(args.data)
        if args.max_shards:
            shards = shards[: args.max_shards]
        manifest.write_text(json.dumps({"data": str(args.data), "shards": [p.name for p in shards]}) + "\n")
    if not shards:
        raise InvalidRequest(f"no shards in {args.data}; run services.train.datagen first")

    loaded = load_target(args.target or find_default_gguf(), torch.float32)
    target = loaded.model
    t = target.config
    t0 = time.perf_counter()
    every = getattr(args, "heldout_every", 50)
    train = load_samples(shards, args.kind, "train", every)
    held_all = load_samples(shards, args.kind, "heldout", every)
    held = held_all[: args.heldout_samples]
    n_tokens = sum(int(s.loss_mask.sum()) for s in train)
    print(f"{len(shards)} shards: {len(train)} training samples ({n_tokens} answer tokens), "
          f"{len(held_all)} held out; loaded in {time.perf_counter() - t0:.0f} s", file=log, flush=True)

    counts = token_counts(shards, t.vocab_size, every)
    k = args.draft_vocab or t.vocab_size
    used = draft_vocab.select(counts, k)
    if args.init:
        head = load_head(args.init, target, torch.float32, draft_vocab=0)  # train on the full projection
        if head.config.kind != args.kind:
            raise InvalidRequest(f"--init {args.init} is a {head.config.kind} head, not {args.kind}")
        head.requires_grad_(False)
    else:
        cfg = HeadConfig(kind=args.kind, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, rms_norm_eps=t.rms_norm_eps,
                         vocab_size=t.vocab_size, rope_theta=t.rope_theta,
                         draft_vocab_size=(k if k < t.vocab_size else None) if args.kind == "eagle3" else None)
        torch.manual_seed(args.seed)
        head = build_head(cfg, target.lm_head).float()
        head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.float())
        if args.kind == "eagle":  # start as "pass the feature through"
            with torch.no_grad():
                head.fc.weight.zero_()
                head.fc.weight[:, t.hidden_size:] = torch.eye(t.hidden_size)
    vocab = None
    if args.kind == "eagle3" and getattr(head, "d2t", None) is not None:
        if args.init is None:
            head.d2t, head.t2d = draft_vocab.d2t_t2d(used, t.vocab_size)
    elif args.kind == "eagle" and k < t.vocab_size:
        vocab = VocabSubset.of(used, t.vocab_size)
    if args.kind == "eagle":  # train against the frozen target head in fp32
        lm = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        lm.weight = torch.nn.Parameter(target.lm_head.weight.detach().float(), requires_grad=False)
        head._target_head = (lm,)

    base = {"init": args.init}
    if args.init:
        base["init_heldout"] = evaluate(head, held, args.eval_depth)
        print(f"init head held-out: {base['init_heldout']}", file=log, flush=True)
    cfg = TrainConfig(args.steps, args.batch_size, args.lr, args.warmup, args.ttt_steps, args.noise,
                      seed=args.seed, checkpoint_every=50, eval_every=args.eval_every, patience=args.patience,
                      max_seconds=60 * getattr(args, "max_minutes", 0.0))
    t1 = time.perf_counter()
    history = train_head(head, train, cfg, out, resume=args.resume, vocab=vocab, heldout=held, log=log)
    train_s = time.perf_counter() - t1
    save_head(head, out, "safetensors", dtype=torch.bfloat16, skip=("embed_tokens.weight",))
    draft_vocab.save_counts(out, counts)

    # dev answers are read now (a datagen run may still be adding to them), evaluation only
    dev = load_samples(list_shards(args.dev_data), args.kind, "all") if args.dev_data else []
    served = load_head(out, target)  # evaluate what was saved (bf16 weights, as served)
    if args.kind == "eagle":
        served._target_head = head._target_head
    report = {
        "target": loaded.path, "kind": args.kind, "draft_vocab": k, "ttt_steps": args.ttt_steps,
        "data": {"dir": str(args.data), "shards": len(shards), "heldout_every": every, "train_samples": len(train),
                 "train_answer_tokens": n_tokens, "heldout_samples": len(held_all),
                 "dev_samples": len(dev)},
        "steps_this_run": len(history), "steps_max": args.steps,
        "batch_size": args.batch_size, "lr": args.lr, "train_s": round(train_s, 1),
        "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "heldout": evaluate(served, held_all, args.eval_depth),
        "dev": evaluate(served, dev, args.eval_depth) if dev else None,
        **base,
    }
    # the budget's prior (services/spec/budget.prior_stats): position-1 agreement on what users ask
    # (the dev answers) when there are any, else on the held-out self-distilled data
    report["top1_agreement"] = (report["dev"] or report["heldout"])["top1"][0]
    compare = args.compare or args.init
    if compare:
        other = load_head(compare, target)
        if other.config.kind == "eagle":
            other._target_head = (target.lm_head,)
        report["compare"] = {"head": compare, "heldout": evaluate(other, held_all, args.eval_depth),
                             "dev": evaluate(other, dev, args.eval_depth) if dev else None}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.tau_prompts:  # after report.json exists: the budget's prior reads it
        from services.train import tau

        report = tau.write(out, tau.measure(out, args.tau_prompts, args.target, args.tau_per_category,
                                            max_new_tokens=args.tau_tokens))
    print(json.dumps(report), file=log, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("AERIE_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["AERIE_TORCH_THREADS"]))
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
