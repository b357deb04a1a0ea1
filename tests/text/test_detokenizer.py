"""services/text.py: the default model's tokenizer loads without weights, and incremental
detokenization never emits a broken character and adds up to a full decode."""

import pytest

from services.text import IncrementalDetokenizer, load_tokenizer

TEXT = "Hello wörld 🦀 naïve 東京 done.\n\n  spaces"


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer(None)  # SmolLM2 (byte-level BPE): an emoji spans several tokens
    assert t is not None
    return t


def test_deltas_add_up_and_never_break_a_character(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # the crab emoji is 4 bytes over several tokens: some pushes return "" while it is incomplete
    assert "" in deltas[:-1]


def test_pushing_rounds_equals_pushing_tokens(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == TEXT


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Hi", add_special_tokens=False) + [eos]
    skip = IncrementalDetokenizer(tok)
    assert skip.push(ids) + skip.flush() == "Hi"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert keep.push(ids) + keep.flush() == "Hi" + tok.eos_token


def test_incomplete_character_at_the_end_is_flushed(tok):
    ids = tok.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == ""
    tail = detok.flush()  # the end of the stream: what is there, replacement characters included
    assert tail and set(tail) == {"\ufffd"}
