"""services/text.py: the target's tokenizer without its weights, and streamed text that never shows
a special token or a broken multi-byte character (the default model's real byte-level BPE tokenizer)."""

from __future__ import annotations

import pytest

from services.errors import CheckpointError
from services.text import REPLACEMENT, IncrementalDetokenizer, load_tokenizer

pytestmark = pytest.mark.slow  # docs/testing.md: loads the default model's tokenizer (~10 s)

JAPANESE = "日本の首都は東京です。美しい桜が咲いています。"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("aerie-cache")


@pytest.fixture(scope="module")
def tok(cache):
    mp = pytest.MonkeyPatch()
    mp.setenv("AERIE_CACHE_DIR", str(cache))
    try:
        yield load_tokenizer(None)
    finally:
        mp.undo()


def test_default_tokenizer_reads_no_weights(tok, cache):
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert files and all(p.parent.name.endswith("-tokenizer") for p in files)
    assert not any(p.suffix in (".safetensors", ".bin") or p.name == "config.json" for p in files)
    assert sum(p.stat().st_size for p in files) < 20 * 2**20  # the GGUF's weights are 517 MB
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."


def test_cached_tokenizer_is_reused(tok, cache, monkeypatch):
    monkeypatch.setenv("AERIE_CACHE_DIR", str(cache))
    import services.text as text

    monkeypatch.setattr(text, "_cache_gguf_tokenizer", lambda *a: pytest.fail("read the GGUF again"))
    assert load_tokenizer(None).encode(JAPANESE) == tok.encode(JAPANESE)


def test_bad_target_names_the_value(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere.bin"):
        load_tokenizer(str(tmp_path / "nowhere.bin"))


def test_japanese_one_token_at_a_time(tok):
    ids = tok.encode(JAPANESE)
    naive = [tok.decode([i]) for i in ids]
    assert any(REPLACEMENT in p for p in naive)  # the text really splits characters across tokens
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids]
    pieces.append(d.flush())
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) == JAPANESE


@pytest.mark.parametrize("sizes", [(2, 3), (1, 4, 2), (5,)])
def test_rounds_of_any_size_and_special_tokens(tok, sizes):
    im_end, im_start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("Tokyo: 東京。") + [im_start] + tok.encode(" Café ☕ ok") + [im_end]
    rounds, i, k = [], 0, 0
    while i < len(ids):
        rounds.append(ids[i:i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(r) for r in rounds] + [d.flush()]
    text = "".join(pieces)
    assert text == tok.decode(ids, skip_special_tokens=True) == "Tokyo: 東京。 Café ☕ ok"
    assert not any(REPLACEMENT in p for p in pieces) and "<|im" not in text


def test_special_tokens_kept_when_asked(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert d.push(tok.encode("Paris.") + [im_end]) + d.flush() == "Paris.<|im_end|>"


def test_incomplete_character_at_the_end_is_flushed_as_a_full_decode_prints_it(tok):
    ids = tok.encode("東")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    assert d.push(ids[:-1]) == ""
    tail = d.flush()
    assert tail == tok.decode(ids[:-1]) and REPLACEMENT in tail
