"""Reduced draft vocabularies (FR-Spec / EAGLE-3 `d2t`): which target tokens a draft may propose.

A draft that projects onto only the K most frequent target tokens is cheaper per step; acceptance is
unchanged (the target still verifies every proposal), so output stays lossless whatever K is.

The frequency ranking travels with a head as `token_counts.safetensors` in its directory:

    counts  int64 [V]   occurrences of each target token id in the target's tokenization of a corpus

A vocabulary of size K is the set `used` = the K highest counts, ties broken by the lower token id
(a stable ranking, so every tool picks the same set), listed in ascending id order. It is encoded the
EAGLE-3 way: `d2t[i] = used[i] - i` (draft id i -> target id i + d2t[i]) and `t2d[j] = j in used`.

    counts [5, 0, 9, 5, 1], K=3 -> ranking [2, 0, 3, 4, 1] -> used [0, 2, 3]
                                -> d2t [0, 1, 1], t2d [T, F, T, T, F]

This module only defines the ranking and the file; heads and the trainer apply it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.errors import CheckpointError

COUNTS_FILE = "token_counts.safetensors"


def ranking(counts: torch.Tensor) -> torch.Tensor:
    """counts [V] -> token ids [V] by descending count, ties by ascending id."""
    return torch.sort(-counts.long(), stable=True).indices


def select(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The K most frequent ids, ascending [K]. K must be in [1, V]."""
    v = counts.shape[0]
    if not 1 <= k <= v:
        raise ValueError(f"draft vocabulary size must be in [1, {v}]; got {k}")
    return torch.sort(ranking(counts)[:k]).values


def d2t_t2d(used: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """used [K] ascending target ids -> (d2t [K] int64 offsets, t2d [V] bool)."""
    d2t = used.long() - torch.arange(used.shape[0])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def save_counts(directory: str | Path, counts: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    path = Path(directory) / COUNTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"counts": counts.long().contiguous().cpu()}, str(path))
    return path


def load_counts(directory: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The head directory's counts [V], or None when it has no frequency file."""
    path = Path(directory) / COUNTS_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        counts = load_file(str(path))["counts"]
    except Exception as e:  # noqa: BLE001 - any unreadable file is a checkpoint error
        raise CheckpointError(f"{path} is not a readable token-count file: {e}") from None
    if counts.ndim != 1 or counts.shape[0] != vocab_size:
        raise CheckpointError(f"{path} holds counts of shape {list(counts.shape)}; the target's vocabulary "
                              f"has {vocab_size} tokens")
    return counts.long()
