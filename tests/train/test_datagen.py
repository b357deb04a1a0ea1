"""datagen: features taken during batched generation equal aerie's own target features for the same
tokens, answers are the target's greedy decoding, and shard directories resume without duplicating
or dropping a prompt (self-instruct follow-ups included)."""

import json

import torch

from services.train.datagen import FeatureHooks, generate_batch, prompt_id, run, scan
from services.train.prompt_source import PromptSpec
from services.train.shards import list_shards, load_samples
from tests.helpers import VOCAB, save_tiny_tokenizer, tiny_hf, to_native


def native_greedy(native, prompt, n, eos=None):
    seq = list(prompt)
    for _ in range(n):
        out = native(torch.tensor(seq), native.new_cache(len(seq)))
        seq.append(int(out.logits[-1].argmax()))
        if seq[-1] == eos:
            break
    return seq[len(prompt):]


def test_batched_features_equal_native_target_and_answers_are_greedy():
    hf = tiny_hf("llama", layers=8, seed=5)  # taps 2, 4, 5 (distinct)
    native = to_native(hf)
    prompts = [[5, 9, 11], [7, 3, 20, 44, 61, 8, 12], [100, 90]]  # different lengths: left padding
    hooks = FeatureHooks(hf)
    assert hooks.tap_layers == native.config.eagle3_tap_layers
    first = generate_batch(hf, hooks, prompts, 6, set(), 0, torch.float32)
    eos = first[0].answer[2]  # makes sample 0 stop early: finished rows leave the batch
    gens = generate_batch(hf, hooks, prompts, 6, {eos}, 0, torch.float32)
    assert gens[0].answer[-1] == eos and len(gens[0].answer) <= 3
    for p, g in zip(prompts, gens):
        assert g.answer == native_greedy(native, p, 6, eos)
        seq = torch.tensor(p + g.answer[:-1])
        out = native(seq, native.new_cache(len(seq)), want_taps=True)
        assert g.hidden.shape == out.hidden.shape and g.taps.shape == out.taps.shape
        torch.testing.assert_close(g.hidden, out.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g.taps, out.taps, atol=1e-4, rtol=1e-4)
    hooks.remove()


def _specs(n):
    g = torch.Generator().manual_seed(1)
    specs = []
    for i in range(n):
        words = " ".join(f"t{int(x)}" for x in torch.randint(3, VOCAB, (4 + i % 3,), generator=g))
        specs.append(PromptSpec(words, "template", "t7 t8 {out}" if i % 4 == 0 else None))
    return specs + [specs[1]]  # a duplicate: generated once


def test_shards_resume_without_duplicating_or_dropping(tmp_path):
    hf = tiny_hf("llama", layers=4, seed=2)
    save_tiny_tokenizer(tmp_path / "tok")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    specs = _specs(10)
    out = tmp_path / "data"
    # the first run stops after 2 batches (as an interrupted run would); a stray .tmp from a crash
    total1 = run(out, specs, hf, tok, max_tokens=20, batch=3, max_new_tokens=5, max_prompt_tokens=64)
    n1 = len(list_shards(out))
    assert 0 < total1 < 100 and n1 >= 2
    (out / "shard-000099.tmp").write_bytes(b"partial")
    total = run(out, specs, hf, tok, max_tokens=10_000, batch=3, max_new_tokens=5, max_prompt_tokens=64)
    done, derived, scanned_total, _ = scan(out)
    ids = []
    for p in list_shards(out):
        from safetensors import safe_open

        with safe_open(str(p), "pt") as f:
            ids += [d["id"] for d in json.loads(f.metadata()["prompts"])]
    unique = {prompt_id(s.text) for s in specs}
    followups = {prompt_id(d.text) for d in derived}
    assert followups and all(d.text.startswith("t7 t8 ") for d in derived)
    assert len(ids) == len(set(ids))  # nothing generated twice
    assert set(ids) == unique | followups  # nothing dropped: every base prompt and every follow-up
    assert total == scanned_total > total1
    samples = load_samples(list_shards(out), "eagle", "all")
    assert sum(int(s.loss_mask.sum()) for s in samples) == total
    for s in samples:  # greedy rows: the recorded next token is the following token
        p = int((s.loss_mask == 0).sum()) + 1
        assert torch.equal(s.next_tokens[p - 1:-1], s.tokens[p:])
