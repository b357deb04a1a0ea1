"""`aerie draft-vocab`: token counts for a reduced draft vocabulary (`--draft-vocab K`, FR-Spec).

    aerie draft-vocab --from FILES... --out HEAD_DIR/token_counts.safetensors [--target T]

Counts the target's tokenization of text files, or the answer tokens of self-distillation shards
(`train` datagen's .safetensors), and writes `token_counts.safetensors` (services/model/draft_vocab.py).
Never build it from an evaluation set (Spec-Bench). Prints one JSON line (tokens, distinct tokens).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aerie_cli.flags import add_command
from services.errors import InvalidRequest


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "draft-vocab", "token counts for a reduced draft vocabulary (--draft-vocab)", __doc__)
    p.add_argument("--from", dest="from_files", nargs="+", required=True,
                   help="corpus: text files (tokenized with the target's tokenizer) and/or self-distillation "
                        "shards (.safetensors; their answer tokens); required")
    p.add_argument("--out", required=True, help="path of the token_counts.safetensors to write (in the head directory); required")
    p.add_argument("--target", default=None,
                   help="target whose tokenizer and vocabulary to use (default: the default model)")
    p.set_defaults(func=cmd_draft_vocab)


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from services.model.draft_vocab import COUNTS_FILE, save_counts
    from services.model.draft_vocab_build import count_corpus
    from services.model.loading import converted_gguf_dir, find_default_gguf, load_tokenizer, read_config

    out = Path(args.out)
    if out.name != COUNTS_FILE:
        raise InvalidRequest(f"--out must name a file called {COUNTS_FILE} (in the head directory); got {out}")
    src = Path(args.target or find_default_gguf()).expanduser()
    model_dir = converted_gguf_dir(src) if src.is_file() else src
    vocab = read_config(model_dir).vocab_size
    counts, total = count_corpus(args.from_files, load_tokenizer(model_dir), vocab)
    save_counts(out.parent, counts)
    print(json.dumps({"out": str(out), "tokens": total, "distinct": int((counts > 0).sum()),
                      "vocab_size": vocab, "files": len(args.from_files)}))
    return 0
