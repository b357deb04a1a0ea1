"""The draft-head training loop: AdamW with warmup + cosine decay, value clipping (as the reference),
a progress bar with loss and top-1 agreement, resumable checkpoints, and held-out evaluation.

It trains the head it is given on the samples it is given; `aerie train-draft` (aerie_cli/train_draft.py)
builds both. Checkpoints (`checkpoint.pt` in the output directory) hold the head, the optimiser, the
scheduler and the step, so an interrupted run continues where it stopped with `--resume`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from services.model.eagle_head import DraftHead
from services.train.distill import Sample, head_loss


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
               resume: bool = False, stop_at: int | None = None) -> list[float]:
    """Train in place; returns the per-step mean top-1 agreement. `stop_at` ends the run early
    (as an interruption would) after checkpointing. WARNING: mutates `head`."""
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
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(samples), generator=gen).tolist()
    head.train()
    history: list[float] = []
    end = min(cfg.steps, stop_at) if stop_at else cfg.steps
    bar = tqdm(range(start, end), desc="training", unit="step", initial=start, total=cfg.steps)
    for step in bar:
        opt.zero_grad()
        losses, accs = [], []
        for j in range(cfg.batch_size):
            s = samples[order[(step * cfg.batch_size + j) % len(samples)]]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
                loss, acc = head_loss(head, s, cfg.ttt_steps, cfg.noise_std)
            (loss / cfg.batch_size).backward()
            losses.append(float(loss.detach()))
            accs.append(float(acc))
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        sched.step()
        history.append(sum(accs) / len(accs))
        window = history[-50:]
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.3f}", acc=f"{sum(window) / len(window):.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": step + 1}, ckpt)
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
