"""Text in and out of token ids, for clients of a target that do not hold its weights.

    tok = load_tokenizer(target)            # the target's tokenizer only (None: the target has none)
    detok = IncrementalDetokenizer(tok)     # one per sequence
    for step in steps:
        print(detok.push(step.tokens), end="")
    print(detok.flush())

`load_tokenizer` never loads or converts the weights: for a .gguf it reads just the tokenizer from the
file's metadata (cached next to the converted models in <cache>/converted/<stem>-<hash>-tokenizer/),
or uses the full conversion's cached tokenizer when one exists. `IncrementalDetokenizer` decodes a
growing sequence so that the concatenated pieces equal `tokenizer.decode(all_ids,
skip_special_tokens=True)`: a multi-byte character split across tokens (or rounds) is held back until
it is complete, and special tokens (`<|im_end|>`) are never printed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from services.errors import CheckpointError

REPLACEMENT = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


def load_tokenizer(target: str | None) -> Any | None:
    """The tokenizer of `target` (a Hugging Face directory or a .gguf file; None = the default model),
    or None when a directory ships no tokenizer files. Never reads the weights."""
    from services.model import loading

    from services.model.hub import resolve_model

    source = target or loading.find_default_gguf()
    path = Path(resolve_model(source)).expanduser()  # a Hub id -> its cached snapshot
    if path.is_dir():
        return loading.load_tokenizer(path)
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise CheckpointError(f"target {source!r} is neither a model directory nor a .gguf file")
    converted = loading.gguf_cache_dir(path)
    if (converted / "config.json").is_file():  # a full conversion already cached its tokenizer
        return loading.load_tokenizer(converted)
    cached = converted.with_name(converted.name + "-tokenizer")
    if not (cached / "tokenizer_config.json").is_file():
        _cache_gguf_tokenizer(path, cached)
    return loading.load_tokenizer(cached)


def _cache_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    """Read only the tokenizer from the GGUF's metadata (transformers' GGUF reader parses the vocabulary
    and merges, never the tensors) and save it as a Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
        tmp.chmod(0o755)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "tokenizer_config.json").is_file():  # not a concurrent writer that won the race
                raise
    except Exception as e:
        raise CheckpointError(f"cannot read the tokenizer of GGUF {gguf_path}: {type(e).__name__}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class IncrementalDetokenizer:
    """Decodes one sequence's ids as they arrive (the prefix-offset algorithm of vLLM / TGI / the
    `tokenizers` DecodeStream): decode a short window of ids before the unprinted ones and after them,
    emit the difference once it does not end in an incomplete character. Every piece is exactly what
    a full decode adds, so `"".join(pieces) + flush() == tokenizer.decode(ids, skip_special_tokens=...)`
    for tokenizers whose decoding is prefix-stable (byte-level BPE, SentencePiece)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ()) if skip_special_tokens else set()
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (already printed)
        self._read_offset = 0  # first id not yet printed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add ids; return the text they complete (possibly empty)."""
        out: list[str] = []
        for t in token_ids:
            t = int(t)
            if t in self._special:
                continue  # never printed; keeping it out also keeps the window free of it
            self._ids.append(t)
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            text = self._decode(self._ids[self._prefix_offset:])
            if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
                out.append(text[len(prefix):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        return "".join(out)

    def flush(self) -> str:
        """The text still held back at the end of the sequence (an incomplete character decodes as
        U+FFFD, as a full decode would print it)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
