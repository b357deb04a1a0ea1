"""Reading datagen shards (services/train/datagen.py) back as training `Sample`s.

    list_shards(dir)                         -> shard paths in write order
    load_samples(paths, kind, split)         -> [Sample] for an EAGLE-1/2 ("eagle") or EAGLE-3 head
    token_counts(paths, vocab_size)          -> [V] counts of the training split's tokens (draft vocab)
    written_prompt_ids(paths)                -> the prompt id of each sample of the "all" split

The split is by prompt (datagen.is_heldout on the prompt's id), so a held-out prompt never has any
of its tokens in training. Features stay bf16 in memory (converted per sample in the loss).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.model.head_kind import HeadKind
from services.train.datagen import SHARD_GLOB, is_heldout
from services.train.distill import Sample


def list_shards(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob(SHARD_GLOB))


def shard_samples(path: Path, kind: HeadKind, split: str = "train", heldout_every: int = 50) -> list[Sample]:
    """Samples of one shard. split: "train", "heldout" or "all"; 1 prompt in `heldout_every` (by
    hash) is held out."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tokens, nxt = f.get_tensor("tokens"), f.get_tensor("next")
        offsets, plens = f.get_tensor("offsets"), f.get_tensor("prompt_lens")
        hidden = f.get_tensor("hidden")
        feats = f.get_tensor("taps") if kind == "eagle3" else hidden
    n = offsets.shape[0] - 1
    written = _written_ids(json.loads(meta["prompts"]), n) if split != "all" else [None] * n
    out = []
    for i, pid in enumerate(written):
        if split != "all" and (split == "heldout") != is_heldout(pid, heldout_every):
            continue
        a, b = int(offsets[i]), int(offsets[i + 1])
        p = int(plens[i])
        mask = torch.zeros(b - a)
        mask[p - 1:] = 1.0
        out.append(Sample(tokens[a:b].long(), feats[a:b], hidden[a:b], nxt[a:b].long().clamp(min=0), mask))
    return out


def written_prompt_ids(paths: list[Path]) -> list[str]:
    """The prompt id of every sample `load_samples(paths, kind, "all")` returns, in the same order."""
    from safetensors import safe_open

    out: list[str] = []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            meta, n = f.metadata(), f.get_slice("offsets").get_shape()[0] - 1
        out += _written_ids(json.loads(meta["prompts"]), n)
    return out


def _written_ids(prompts: list[dict], n: int) -> list[str]:
    """Prompt ids of the n written samples, in order (prompts with written=false have no sample)."""
    if n == len(prompts):
        return [p["id"] for p in prompts]
    written = [p["id"] for p in prompts if p.get("written", True)]
    if len(written) != n:
        raise ValueError(f"shard lists {len(prompts)} prompts ({len(written)} written) but holds {n} samples")
    return written


def load_samples(paths: list[Path], kind: HeadKind, split: str = "train", heldout_every: int = 50) -> list[Sample]:
    out = []
    for p in paths:
        out += shard_samples(p, kind, split, heldout_every)
    return out


def token_counts(paths: list[Path], vocab_size: int, heldout_every: int = 50) -> torch.Tensor:
    """Token counts over the training split (prompt and answer tokens) for draft_vocab.select."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for p in paths:
        for s in shard_samples(p, "eagle", "train", heldout_every):
            counts += torch.bincount(s.tokens, minlength=vocab_size)
    return counts
