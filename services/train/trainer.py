"""The draft-head training loop: AdamW with warmup + cosine decay, value clipping (as the reference),
a progress bar with loss and top-1 agreement, resumable checkpoints, and held-out evaluation.

It trains the head it is given on the samples it is given; `aerie train-draft` (aerie_cli/train_draft.py)
builds both. Checkpoints (`checkpoint.pt` in the output directory) hold the head, the optimiser, the
scheduler and the step, so an interrupted run continues where it stopped with `--resume`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from services.model.eagle_head import DraftHead
from services.train.distill import Sample, StepStats, VocabSubset, head_loss


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 2000  # optimiser steps
    batch_size: int = 4  # samples per step (gradient accumulation)
    lr: float = 1e-3
    warmup: int = 100
    ttt_steps: int = 3  # unrolled draft steps per sample (1 = plain EAGLE-1 objective)
    noise_std: float = 0.0  # uniform feature noise width (the reference uses 0.2 * 512 / T)
    seed: int = 0
    checkpoint_every: int = 100
    bf16_autocast: bool = False  # the reference trains under bf16 autocast; torch's CPU bf16 matmul is slow
    eval_every: int = 0  # held-out evaluation every N steps (0 = never)
    patience: int = 0  # stop after this many evaluations without a better held-out top-1 (0 = never)
    max_seconds: float = 0.0  # stop (checkpointed, resumable) after this much training time (0 = never)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "ttt_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def train_head(head: DraftHead, samples: list[Sample], cfg: TrainConfig, out_dir: Path,
               resume: bool = False, stop_at: int | None = None, vocab: VocabSubset | None = None,
               heldout: list[Sample] | None = None, log=None) -> list[float]:
    """Train in place; returns the per-step mean top-1 agreement. `stop_at` ends the run early
    (as an interruption would) after checkpointing. `vocab` restricts the loss to a reduced draft
    vocabulary. With `heldout` and cfg.eval_every, held-out top-1 agreement (draft position 1) is
    measured every eval_every steps, the best head is kept (DIR/best.pt) and restored at the end,
    and training stops early after cfg.patience evaluations without improvement; the evaluations
    go to DIR/evals.jsonl. Sample order is a fixed function of (seed, step), so a resumed run sees
    exactly the samples the uninterrupted one would. WARNING: mutates `head`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    start = 0
    ckpt = out_dir / "checkpoint.pt"
    if resume and ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
    best, best_step, bad_evals = -1.0, 0, 0
    if resume and ckpt.is_file():
        best, best_step, bad_evals = state.get("best", (-1.0, 0, 0))
    orders: dict[int, list[int]] = {}

    def sample_at(i: int) -> Sample:  # epoch e uses permutation seed + e
        e = i // len(samples)
        if e not in orders:
            orders[e] = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed + e)).tolist()
        return samples[orders[e][i % len(samples)]]

    head.train()
    history: list[float] = []
    end = min(cfg.steps, stop_at) if stop_at else cfg.steps
    bar = tqdm(range(start, end), desc="training", unit="step", initial=start, total=cfg.steps)
    t_start = time.monotonic()
    for step in bar:
        opt.zero_grad()
        losses, accs = [], []
        for j in range(cfg.batch_size):
            s = sample_at(step * cfg.batch_size + j)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
                loss, acc = head_loss(head, s, cfg.ttt_steps, cfg.noise_std, vocab=vocab)
            (loss / cfg.batch_size).backward()
            losses.append(float(loss.detach()))
            accs.append(float(acc))
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        sched.step()
        history.append(sum(accs) / len(accs))
        window = history[-50:]
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.3f}", acc=f"{sum(window) / len(window):.3f}")
        stop = bool(cfg.max_seconds) and time.monotonic() - t_start > cfg.max_seconds
        if heldout and cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            ev = evaluate(head, heldout, depth=cfg.ttt_steps)
            head.train()
            top1 = ev["top1"][0]
            if top1 > best:
                best, best_step, bad_evals = top1, step + 1, 0
                torch.save(head.state_dict(), out_dir / "best.pt")
            else:
                bad_evals += 1
                stop = stop or (bool(cfg.patience) and bad_evals >= cfg.patience)
            line = {"step": step + 1, "train_top1": round(sum(window) / len(window), 4),
                    "heldout": ev, "best_step": best_step}
            with open(out_dir / "evals.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            if log:
                print(json.dumps(line), file=log, flush=True)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end or stop:
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": step + 1,
                        "best": (best, best_step, bad_evals)}, ckpt)
        if stop:
            break
    if heldout and cfg.eval_every and (out_dir / "best.pt").is_file():
        head.load_state_dict(torch.load(out_dir / "best.pt", map_location="cpu"))
    head.eval().requires_grad_(False)
    return history


@torch.no_grad()
def agreement(head: DraftHead, samples: list[Sample]) -> float:
    """Step-0 top-1 agreement with the target on held-out samples (response tokens only)."""
    was_training = head.training
    head.eval()
    hits = total = 0.0
    for s in samples:
        _, acc = head_loss(head, s, steps=1)
        n = float(s.loss_mask[1:].sum())
        hits += float(acc) * n
        total += n
    head.train(was_training)
    return hits / max(total, 1.0)


def evaluate(head: DraftHead, samples: list[Sample], depth: int = 4, topk: int = 4,
             vocab: VocabSubset | None = None) -> dict:
    """Teacher-forced agreement per draft position 1..depth on answer tokens: position k feeds the
    head its own outputs for k-1 steps with the target's tokens (an accepted chain), as inference
    does. Returns {"top1": [depth], f"top{topk}": [depth], "tokens": answer tokens scored}."""
    return evaluate_groups(head, samples, {}, depth, topk, vocab)[0]


@torch.no_grad()
def evaluate_groups(head: DraftHead, samples: list[Sample], groups: dict[str, list[int]], depth: int = 4,
                    topk: int = 4, vocab: VocabSubset | None = None) -> tuple[dict, dict[str, dict]]:
    """`evaluate` of all samples and of each group (indices into `samples`), every sample scored once."""
    was_training = head.training
    head.eval()
    per_sample: list[list[StepStats]] = []
    for s in samples:
        per_sample.append([])
        head_loss(head, s, steps=depth, vocab=vocab, topk=topk, stats=per_sample[-1])
    head.train(was_training)

    def summary(stats: list[StepStats]) -> dict:
        if not stats:
            return {"top1": [0.0] * depth, f"top{topk}": [0.0] * depth, "tokens": 0}
        rows = sum(st.rows for st in stats)
        top1 = sum(st.top1 for st in stats) / rows.clamp(min=1)
        topk_ = sum(st.topk for st in stats) / rows.clamp(min=1)
        return {"top1": [round(float(x), 4) for x in top1], f"top{topk}": [round(float(x), 4) for x in topk_],
                "tokens": int(rows[0])}

    every = [st for stats in per_sample for st in stats]
    return summary(every), {g: summary([st for i in idx for st in per_sample[i]]) for g, idx in groups.items()}
