"""Text for the services that speak it: the target's tokenizer (never its weights) and incremental
detokenization of a token stream.

    tok = load_tokenizer(target)                  # None target = the default model
    detok = IncrementalDetokenizer(tok)
    for ids in rounds: print(detok.push(ids), end="")
    print(detok.flush())

`push` returns only text whose bytes are complete: a token that ends inside a multi-byte character
(byte-fallback tokenizers split an emoji over several tokens) is held until the character completes,
so no delta ever carries U+FFFD for a character that is still coming. The concatenation of every
`push` and the final `flush` equals `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPLACEMENT = "\ufffd"


def load_tokenizer(target: str | None) -> Any | None:
    """The target's tokenizer, or None when the target ships none. `target`: a Hugging Face
    directory, a .gguf file (only its tokenizer is read; an already converted directory is reused),
    or None for the default model."""
    from services.model.loading import find_default_gguf, gguf_cache_dir
    from services.model.loading import load_tokenizer as load_dir_tokenizer

    path = Path(target or find_default_gguf()).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        converted = gguf_cache_dir(path)
        tok = load_dir_tokenizer(converted) if converted.is_dir() else None
        if tok is not None:
            return tok
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not path.is_dir():
        return None
    return load_dir_tokenizer(path)


class IncrementalDetokenizer:
    """One per sequence. Decodes a sliding window (the last emitted token as context, so word-boundary
    spaces come out as a full decode would) instead of the whole sequence on every push."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: the context tokens already emitted
        self._read = 0  # ids[:_read] are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text ("" while a character is incomplete)."""
        self.ids.extend(int(t) for t in token_ids)
        if self._read == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT) or not text.startswith(prefix):
            return ""  # an incomplete character (or a special token skipped): wait for more tokens
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character decodes as U+FFFD here)."""
        if self._read == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix):] if text.startswith(prefix) else text
