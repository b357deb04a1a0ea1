"""Build a head's token-frequency file (`token_counts.safetensors`, draft_vocab.py) from a corpus.

    counts = count_corpus(["notes.txt", "/work/data/head-data/shard-000000.safetensors"], tokenizer, V)

A file is either text (tokenized with the TARGET's tokenizer, no special tokens added) or a
self-distillation shard (`services/train/datagen.py`: its `next` tensor holds the target's own
answer tokens, -1 on prompt rows; only those answer tokens are counted). Never build counts from an
evaluation set (Spec-Bench): the reduced vocabulary would be tuned on the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.errors import CheckpointError, InvalidRequest


def count_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [N] int (values outside [0, V) are ignored) -> counts [V] int64."""
    ids = ids.long().flatten()
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.bincount(ids, minlength=vocab_size)


def file_ids(path: Path, tokenizer: Any | None) -> torch.Tensor:
    """The token ids one corpus file contributes."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                if "next" not in f.keys():
                    raise CheckpointError(f"{path} is not a self-distillation shard (no `next` tensor)")
                return f.get_tensor("next")
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable file
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if tokenizer is None:
        raise InvalidRequest(f"{path} is text but the target has no tokenizer")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read {path} as UTF-8 text: {e}") from None
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def count_corpus(paths: list[str | Path], tokenizer: Any | None, vocab_size: int) -> tuple[torch.Tensor, int]:
    """(counts [V] int64, tokens counted) over every file; a missing file is an InvalidRequest."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for p in map(Path, paths):
        if not p.is_file():
            raise InvalidRequest(f"corpus file {p} does not exist")
        counts += count_ids(file_ids(p, tokenizer), vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise InvalidRequest(f"the corpus ({len(paths)} files) holds no tokens of the target's vocabulary")
    return counts, total
