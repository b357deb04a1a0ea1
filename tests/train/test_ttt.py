"""Training-time test, reduced draft vocabularies and the shard pipeline on tiny targets:
the unrolled loss is not the single-step loss and lowers multi-step error, held-out agreement rises
past what the untrained head reaches, and a head trained with a draft vocabulary is written in the
published EAGLE-3 format and loads in aerie."""

import json

import pytest
import torch

from services.model import draft_vocab
from services.model.eagle_head import HeadConfig, build_head
from services.model.head_checkpoint import load_head
from services.train.distill import VocabSubset, collect, head_loss
from services.train.trainer import TrainConfig, evaluate, train_head
from tests.helpers import HIDDEN, VOCAB, save_tiny_tokenizer, tiny_hf, to_native


def fresh(target, kind="eagle", draft=None):
    torch.manual_seed(0)
    head = build_head(HeadConfig(kind, HIDDEN, 128, 4, 2, 1e-6, VOCAB, draft_vocab_size=draft), target.lm_head)
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    return head


def samples(target, n, seed, taps=False):
    g = torch.Generator().manual_seed(seed)
    return [collect(target, torch.randint(0, VOCAB, (6,), generator=g).tolist(), 40, taps) for _ in range(n)]


def test_unrolled_loss_differs_and_reduces_multi_step_error(tmp_path):
    # EAGLE-3: the head's output is never a regression target, so without TTT nothing teaches it to
    # be a usable input for the next draft step
    target = to_native(tiny_hf("llama", layers=8, seed=3))  # taps from layers 2, 4, 5
    train, held = samples(target, 24, 1, taps=True), samples(target, 8, 2, taps=True)
    head = fresh(target, "eagle3")
    one, _ = head_loss(head, train[0], steps=1)
    three, _ = head_loss(head, train[0], steps=3)
    assert not torch.isclose(one, three)  # later steps add their own (decayed) terms
    heads = {}
    for ttt in (1, 3):
        h = fresh(target, "eagle3")
        train_head(h, train, TrainConfig(steps=120, batch_size=4, lr=3e-3, warmup=10, ttt_steps=ttt),
                   tmp_path / f"ttt{ttt}")
        heads[ttt] = evaluate(h, held, depth=3)
    # position 1 is learnt either way; positions 2 and 3 (the head consuming its own outputs) only with TTT
    assert heads[1]["top1"][0] > 0.6 and heads[3]["top1"][0] > 0.6
    assert heads[3]["top1"][1] > heads[1]["top1"][1] + 0.3
    assert heads[3]["top1"][2] > heads[1]["top1"][2] + 0.3


def test_reduced_vocabulary_training_raises_heldout_agreement(tmp_path):
    target = to_native(tiny_hf("llama", layers=2, seed=3))
    train, held = samples(target, 24, 1), samples(target, 8, 2)
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for s in train:
        counts += torch.bincount(s.tokens, minlength=VOCAB)
    vocab = VocabSubset.of(draft_vocab.select(counts, 64), VOCAB)
    head = fresh(target)
    before = evaluate(head, held, depth=2)["top1"][0]
    cfg = TrainConfig(steps=120, batch_size=4, lr=3e-3, warmup=10, ttt_steps=2, eval_every=40, patience=5)
    train_head(head, train, cfg, tmp_path, vocab=vocab, heldout=held)
    after = evaluate(head, held, depth=2)["top1"][0]  # scored over the full vocabulary, as served
    assert before < 0.3 < after
    evals = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [40, 80, 120]


def test_pipeline_writes_eagle3_head_with_draft_vocab_that_loads(tmp_path):
    from services.train import datagen, pipeline
    from services.train.prompt_source import PromptSpec
    from transformers import AutoTokenizer

    hf = tiny_hf("llama", layers=8, seed=4)
    model_dir = tmp_path / "model"
    hf.save_pretrained(str(model_dir))
    save_tiny_tokenizer(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    g = torch.Generator().manual_seed(0)
    specs = [PromptSpec(" ".join(f"t{int(x)}" for x in torch.randint(3, VOCAB, (5,), generator=g)), "template")
             for _ in range(16)]
    datagen.run(tmp_path / "data", specs, hf, tok, max_tokens=10_000, batch=8, max_new_tokens=24,
                max_prompt_tokens=64)
    rows = [{"question_id": i, "category": "qa", "turns": [specs[i].text]} for i in range(2)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = pipeline.build_parser().parse_args([
        "--data", str(tmp_path / "data"), "--dev-data", str(tmp_path / "data"), "--out", str(tmp_path / "head"),
        "--target", str(model_dir), "--kind", "eagle3", "--draft-vocab", "48", "--steps", "6",
        "--batch-size", "2", "--eval-every", "3", "--eval-depth", "2",
        "--tau-prompts", str(tmp_path / "prompts.jsonl"), "--tau-tokens", "8"])
    report = pipeline.run(args)
    out = tmp_path / "head"
    # tau with the cost-model budget: the saved head served by aerie's engine, token-exact
    assert json.loads((out / "report.json").read_text()) == report
    assert report["tau"]["prompts"] == 1 and report["tau"]["exact_match"] == 1.0 and report["tau"]["tau"] >= 1.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 48
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        d2t = f.get_tensor("d2t")
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight", "norm.weight"} <= keys
    assert any(k.startswith("midlayer.") for k in keys)
    counts = draft_vocab.load_counts(out, VOCAB)
    used = draft_vocab.select(counts, 48)
    assert torch.equal(d2t + torch.arange(48), used)  # d2t is the frequency ranking of the training data
    native = to_native(hf)
    head = load_head(out, native)
    assert head.config.draft_vocab == 48 and torch.equal(head.to_target(torch.arange(48)), used)
    assert report["data"]["train_answer_tokens"] > 0 and len(report["dev"]["top1"]) == 2
    # the budget's prior comes from the dev answers' position-1 agreement
    assert report["top1_agreement"] == report["dev"]["top1"][0]
    from services.engine.calibration import load_report
    from services.spec.acceptance import prior_stats
    assert prior_stats(load_report(out)).depth[0] == pytest.approx(min(0.95, max(0.01, report["top1_agreement"])))


def test_evaluate_scores_a_head_restricted_to_a_draft_vocabulary_as_served(tmp_path):
    # a served EAGLE-2 head projects onto K rows (restrict_vocab): its logits' columns are draft ids,
    # and evaluation maps the target's tokens onto them (a token outside the K counts as a miss)
    target = to_native(tiny_hf("llama", layers=2, seed=3))
    train, held = samples(target, 12, 1), samples(target, 6, 2)
    head = fresh(target)
    train_head(head, train, TrainConfig(steps=60, batch_size=4, lr=3e-3, warmup=5, ttt_steps=1), tmp_path)
    full = evaluate(head, held, depth=2)
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for s in held:
        counts += torch.bincount(s.next_tokens.clamp(min=0), minlength=VOCAB)
    head.restrict_vocab(counts, int((counts > 0).sum()))  # every token the held-out answers need
    assert head.draft_vocab_size < VOCAB
    restricted = evaluate(head, held, depth=2)
    # the same hits or more: the restricted argmax can only gain where the full one picked a token
    # that is never the answer
    assert restricted["tokens"] == full["tokens"]
    assert restricted["top1"][0] >= full["top1"][0] > 0.3
    head.restrict_vocab(counts, 1)  # one token: most answers are outside it, so agreement collapses
    assert evaluate(head, held, depth=2)["top1"][0] < full["top1"][0] / 2


def test_evaluate_per_category_splits_the_dev_answers_by_their_prompt_file(tmp_path, capsys):
    """`evaluate --categories`: each sample goes to its prompt's category (by the first turn, as datagen
    --prompts reads it), so the categories' token counts add up to the whole; a sample whose prompt is
    not in the file is left out."""
    from services.model.head_checkpoint import save_head
    from services.train import datagen
    from services.train import evaluate as ev
    from services.train.prompt_source import PromptSpec
    from services.train.shards import list_shards, written_prompt_ids
    from transformers import AutoTokenizer

    hf = tiny_hf("llama", layers=8, seed=6)  # datagen records the EAGLE-3 taps too
    model_dir = tmp_path / "model"
    hf.save_pretrained(str(model_dir))
    save_tiny_tokenizer(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [" ".join(f"t{3 + (7 * i + j) % 120}" for j in range(5)) for i in range(6)]
    rows = [{"question_id": i, "category": ["qa", "rag", "qa"][i % 3], "turns": [t, "follow-up"]}
            for i, t in enumerate(texts[:5])]  # the sixth prompt is not in the file
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datagen.run(tmp_path / "data", [PromptSpec(t, "file") for t in texts], hf, tok, max_tokens=10_000, batch=4,
                max_new_tokens=12, max_prompt_tokens=64)
    ids = written_prompt_ids(list_shards(tmp_path / "data"))
    assert sorted(ids) == sorted(datagen.prompt_id(t) for t in texts)
    groups = ev.categories(str(tmp_path / "dev.jsonl"), ids)
    assert {c: len(v) for c, v in groups.items()} == {"qa": 3, "rag": 2}
    assert ids[groups["rag"][0]] in {datagen.prompt_id(texts[1]), datagen.prompt_id(texts[4])}
    save_head(fresh(to_native(hf)), tmp_path / "head")
    assert ev.main(["--head", str(tmp_path / "head"), "--data", str(tmp_path / "data"), "--target",
                    str(model_dir), "--depth", "2", "--categories", str(tmp_path / "dev.jsonl")]) == 0
    row = json.loads(capsys.readouterr().out)
    per = row["categories"]
    assert set(per) == {"qa", "rag"} and all(len(v["top1"]) == 2 for v in per.values())
    assert 0 < per["qa"]["tokens"] + per["rag"]["tokens"] < row["tokens"]  # the sixth prompt's tokens
    with pytest.raises(Exception, match="--categories needs --split all"):
        ev.main(["--head", str(tmp_path / "head"), "--data", str(tmp_path / "data"), "--split", "heldout",
                 "--categories", str(tmp_path / "dev.jsonl")])
