"""`aerie train-draft`: self-distil an EAGLE head for a target and write it in the published format.

    aerie train-draft --out DIR [--target T] [--prompts FILE] [--text FILE ...] [--steps N] ...

1. prompts (a file, or the built-in set) -> the target's greedy responses (cached in DIR/data.pt)
2. one target forward per sample -> features and the target's argmax
3. training (progress bar with loss and agreement; DIR/checkpoint.pt; --resume continues)
4. DIR/config.json + DIR/model.safetensors, then held-out top-1 agreement and tau -> DIR/report.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from aerie_cli.flags import add_command
from services.errors import InvalidRequest
from services.model.head_kind import HEAD_KINDS


def register(sub) -> None:
    p = add_command(sub, "train-draft", "train an EAGLE head on the target's own responses", __doc__)
    p.add_argument("--out", required=True, help="output head directory (required)")
    p.add_argument("--target", default=None, help="target model (default: the default model)")
    p.add_argument("--kind", choices=HEAD_KINDS, default="eagle", help="head type (eagle = EAGLE-1/2)")
    p.add_argument("--draft-vocab", type=int, default=0, help="EAGLE-3 reduced draft vocabulary (0 = full)")
    p.add_argument("--prompts", default=None, help=".jsonl/.txt prompts (default: the built-in set)")
    p.add_argument("--num-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    p.add_argument("--text", nargs="*", default=[], help="plain text files to train on as well")
    p.add_argument("--heldout", type=int, default=16, help="prompts held out for evaluation")
    p.add_argument("--max-new-tokens", type=int, default=192, help="response length cap")
    p.add_argument("--data-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the target when generating data and features (the serving dtype)")
    p.add_argument("--device", default=None,
                   help="device of the target's forward passes (data generation, held-out evaluation): "
                        "cpu, cuda or cuda:N (AERIE_DEVICE; default: cuda when available, else cpu); the head "
                        "itself trains on the CPU")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="samples per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--ttt-steps", type=int, default=2, help="unrolled draft steps per sample")
    p.add_argument("--bf16-train", action="store_true",
                   help="train under bf16 autocast (as the reference; faster on GPUs, slower on this CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt order, initialisation and batches")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt and DIR/data.pt")
    p.add_argument("--eval-tree", default="16/4/4", help="tree tokens/depth/top_k for the held-out tau")
    p.add_argument("--eval-max-new-tokens", type=int, default=96, help="response length of the held-out tau")
    g = p.add_argument_group("training on datagen shards (python -m services.train.datagen)")
    g.add_argument("--data", default=None, help="shard directory: train on it instead of --prompts/--text (default: none, self-distil from --prompts/--text)")
    g.add_argument("--dev-data", default=None, help="shards of the Spec-Bench dev answers, evaluation only (default: none, no dev evaluation)")
    g.add_argument("--init", default=None, help="start from this head directory (default: none, a fresh head)")
    g.add_argument("--compare", default=None, help="also evaluate this head directory (default: --init)")
    g.add_argument("--max-shards", type=int, default=0, help="use the first N shards (0 = all)")
    g.add_argument("--noise", type=float, default=0.0, help="uniform feature noise width")
    g.add_argument("--eval-every", type=int, default=200, help="held-out evaluation every N steps")
    g.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (resumable)")
    g.add_argument("--patience", type=int, default=4, help="stop after N evaluations without improvement")
    g.add_argument("--heldout-samples", type=int, default=64, help="held-out samples evaluated during training")
    g.add_argument("--heldout-every", type=int, default=50, help="1 prompt in N (by hash) is held out")
    g.add_argument("--eval-depth", type=int, default=4, help="draft positions in the report")
    p.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    if args.data:
        from services.train import pipeline

        pipeline.run(args)
        return 0
    import torch

    from services.engine.drafter import Drafter
    from services.engine.engine import Engine, GenerationRequest
    from services.engine.local import DTYPES
    from services.engine.verifier import Verifier
    from services.model.eagle_head import HeadConfig, build_head
    from services.model.head_checkpoint import save_head
    from services.model.loading import find_default_gguf, load_target
    from services.train.data import chat_ids, generate_responses, load_prompts, make_sample, text_chunks
    from services.model import draft_vocab
    from services.train.prompts import default_prompts
    from services.train.trainer import TrainConfig, agreement, train_head

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_tree = _parse_tree(args.eval_tree)
    cfg = TrainConfig(args.steps, args.batch_size, args.lr, args.warmup, args.ttt_steps, seed=args.seed,
                      bf16_autocast=args.bf16_train)
    target_source = args.target or find_default_gguf()  # what the user gave (a .gguf, not its cache)
    from services.device import resolve_device

    loaded = load_target(target_source, DTYPES[args.data_dtype], resolve_device(args.device))
    target, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise InvalidRequest("train-draft needs a target with a tokenizer")
    prompts = load_prompts(args.prompts) if args.prompts else default_prompts(args.seed)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    if len(prompts) <= args.heldout:
        raise InvalidRequest(f"need more than --heldout={args.heldout} prompts; got {len(prompts)}")
    train_prompts = prompts[: -args.heldout]  # the last --heldout prompts never reach training
    want_taps = args.kind == "eagle3"
    eos = tuple(sorted(set(target.config.eos_token_ids) | {int(tok.eos_token_id)}))

    key = hashlib.sha256(json.dumps([loaded.path, prompts, args.text, args.max_new_tokens,
                                     args.data_dtype, want_taps]).encode()).hexdigest()[:16]
    data_path = out / "data.pt"
    t0 = time.perf_counter()
    if args.resume and data_path.is_file() and torch.load(data_path, weights_only=False)["key"] == key:
        data = torch.load(data_path, weights_only=False)
        print(f"reusing {len(data['train'])} + {len(data['heldout'])} samples from {data_path}")
    else:
        prompt_ids = [chat_ids(tok, p) for p in prompts]
        responses = generate_responses(target, prompt_ids, args.max_new_tokens, eos)
        samples = [make_sample(target, p, r, want_taps) for p, r in zip(prompt_ids, responses)]
        texts = [make_sample(target, c[:1], c[1:], want_taps)
                 for c in text_chunks(tok, args.text, 256)]
        n_train = len(train_prompts)
        data = {"key": key, "train": samples[:n_train] + texts, "heldout": samples[n_train:],
                "heldout_prompt_ids": prompt_ids[n_train:]}
        torch.save(data, data_path)
    data_s = time.perf_counter() - t0
    n_tokens = sum(int(s.loss_mask.sum()) for s in data["train"])
    print(f"data: {len(data['train'])} training samples ({n_tokens} trained tokens), "
          f"{len(data['heldout'])} held out, {data_s:.0f} s")

    t = target.config
    head_cfg = HeadConfig(
        kind=args.kind, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, rms_norm_eps=t.rms_norm_eps,
        vocab_size=t.vocab_size, rope_theta=t.rope_theta,
        draft_vocab_size=args.draft_vocab or None if args.kind == "eagle3" else None)
    if head_cfg.head_dim != t.head_dim:
        raise InvalidRequest(f"the target's head_dim {t.head_dim} != hidden/heads; not supported for heads")
    torch.manual_seed(args.seed)
    head = build_head(head_cfg, target.lm_head).float().cpu()  # the head trains on the CPU
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.float().cpu())
    if args.kind == "eagle":
        with torch.no_grad():  # start as "predict the current feature": fc passes the feature through
            head.fc.weight.zero_()
            head.fc.weight[:, t.hidden_size:] = torch.eye(t.hidden_size)
    elif head_cfg.draft_vocab < t.vocab_size:
        counts = torch.bincount(torch.cat([s.tokens for s in data["train"]]), minlength=t.vocab_size)
        head.d2t, head.t2d = draft_vocab.d2t_t2d(draft_vocab.select(counts, head_cfg.draft_vocab),
                                                   head_cfg.vocab_size)
    lm_head_float = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    lm_head_float.weight = torch.nn.Parameter(target.lm_head.weight.detach().float().cpu(), requires_grad=False)
    if args.kind == "eagle":
        head._target_head = (lm_head_float,)  # train in fp32 against the frozen target head

    t1 = time.perf_counter()
    train_head(head, data["train"], cfg, out, resume=args.resume)
    train_s = time.perf_counter() - t1
    save_head(head, out, "safetensors", dtype=torch.bfloat16, skip=("embed_tokens.weight",))

    # held-out evaluation with the saved head, in the serving dtype
    from services.model.head_checkpoint import load_head
    served = load_head(out, target)
    top1 = agreement(head, data["heldout"])
    engine = Engine(Verifier(target, served.feature_kind), Drafter(served, eval_tree),
                    t.max_context, t.vocab_size, eos)
    accepts: list[int] = []
    for ids in data["heldout_prompt_ids"]:
        for step in engine.generate(GenerationRequest(tuple(ids), args.eval_max_new_tokens)):
            if step.stats.round_index:
                accepts.append(step.stats.accept_length)
    tau = sum(accepts) / max(len(accepts), 1)
    report = {"target": target_source, "kind": args.kind, "train_samples": len(data["train"]),
              "trained_tokens": n_tokens, "heldout_prompts": len(data["heldout"]), "steps": cfg.steps,
              "top1_agreement": round(top1, 4), "tau": round(tau, 4),
              "eval_tree": {"tokens": eval_tree.size, "depth": eval_tree.depth, "top_k": eval_tree.top_k},
              "data_s": round(data_s, 1), "train_s": round(train_s, 1)}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


def _parse_tree(text: str):
    from services.spec.tree import TreeParams
    try:
        tokens, depth, top_k = (int(x) for x in text.split("/"))
    except ValueError:
        raise InvalidRequest(f"tree must be tokens/depth/top_k, e.g. 16/4/4; got {text!r}") from None
    return TreeParams(top_k, depth, tokens)
