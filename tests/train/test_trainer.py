"""Draft-head training: agreement improves, checkpoints resume exactly, d2t follows the reference,
and `aerie train-draft` writes a loadable head with a report, end to end on a tiny target."""

import json

import pytest
import torch

from aerie_cli.main import main
from services.model.eagle_head import HeadConfig, build_head
from services.model.head_checkpoint import load_head
from services.model import draft_vocab
from services.train.distill import collect
from services.train.trainer import TrainConfig, agreement, train_head
from tests.helpers import HIDDEN, VOCAB, save_tiny_tokenizer, tiny_hf, tiny_text, to_native


def fresh_head(target):
    torch.manual_seed(0)
    head = build_head(HeadConfig("eagle", HIDDEN, 128, 4, 2, 1e-6, VOCAB), target.lm_head)
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    return head


def samples(target, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [collect(target, torch.randint(0, VOCAB, (6,), generator=g).tolist(), 40, False) for _ in range(n)]


def test_training_raises_agreement_and_resumes_exactly(tmp_path):
    target = to_native(tiny_hf("llama", layers=2, seed=3))
    train, held = samples(target, 16, 1), samples(target, 4, 2)
    head = fresh_head(target)
    before = agreement(head, held)
    cfg = TrainConfig(steps=60, batch_size=2, lr=3e-3, warmup=5, ttt_steps=2, bf16_autocast=False,
                      checkpoint_every=30)
    train_head(head, train, cfg, tmp_path / "a")
    after = agreement(head, held)
    assert after > before + 0.2, (before, after)
    # an interrupted run (stopped at step 30) resumed to 60 ends with the same weights
    b = fresh_head(target)
    train_head(b, train, cfg, tmp_path / "b", stop_at=30)
    state = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 30
    c = fresh_head(target)
    train_head(c, train, cfg, tmp_path / "b", resume=True)
    for (k, v), (_, w) in zip(head.state_dict().items(), c.state_dict().items()):
        assert torch.allclose(v, w, atol=1e-6), k


def test_d2t_is_the_reference_construction():
    counts = torch.tensor([5, 0, 9, 1, 7, 3])
    d2t, t2d = draft_vocab.d2t_t2d(draft_vocab.select(counts, 3), 6)
    used = torch.tensor([0, 2, 4])  # the 3 most frequent, sorted
    assert torch.equal(d2t, used - torch.arange(3))
    assert t2d.tolist() == [True, False, True, False, True, False]


def test_train_draft_cli_end_to_end(tmp_path, capsys):
    target_dir = tmp_path / "target"
    tiny_hf("llama", layers=2, seed=7).save_pretrained(target_dir)
    save_tiny_tokenizer(target_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(tiny_text(s, 8) for s in range(14)) + "\n")
    out = tmp_path / "head"
    given = f"{tmp_path}/./target"  # the report names the target as given, not the path aerie loaded
    code = main(["train-draft", "--target", given, "--out", str(out), "--prompts", str(prompts),
                 "--heldout", "4", "--max-new-tokens", "24", "--steps", "30", "--batch-size", "2",
                 "--lr", "3e-3", "--warmup", "3", "--data-dtype", "fp32", "--eval-max-new-tokens", "16"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == given
    assert report["train_samples"] == 10 and report["heldout_prompts"] == 4
    assert (out / "checkpoint.pt").is_file() and (out / "data.pt").is_file()
    from services.engine.drafter import Drafter
    from services.engine.engine import Engine, GenerationRequest
    from services.engine.verifier import Verifier
    from services.model.loading import load_target
    from services.spec.tree import TreeParams

    loaded = load_target(str(target_dir))
    target = loaded.model
    head = load_head(out, target)
    eos = tuple(sorted(set(target.config.eos_token_ids) | {int(loaded.tokenizer.eos_token_id)}))
    # the report's numbers are the saved head's: tau recomputed independently on the held-out prompts
    data = torch.load(out / "data.pt", weights_only=False)
    assert report["eval_tree"] == {"tokens": 16, "depth": 4, "top_k": 4}
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, TreeParams(4, 4, 16)),
                    target.config.max_context, VOCAB, eos)
    steps = [s for ids in data["heldout_prompt_ids"]
             for s in engine.generate(GenerationRequest(tuple(ids), 16)) if s.stats.round_index]
    assert report["tau"] == round(sum(s.stats.accept_length for s in steps) / len(steps), 4)
    # and top-1 agreement is the trained head's on the held-out samples (bf16 storage moves it a little)
    assert report["top1_agreement"] == pytest.approx(agreement(head, data["heldout"]), abs=0.05)
    assert "embed_tokens.weight" not in __import__("safetensors.torch", fromlist=["x"]).load_file(
        out / "model.safetensors")  # the frozen embedding is not duplicated into the head file
    assert head.config.vocab_size == VOCAB
    # --resume reuses the generated data and the finished checkpoint
    capsys.readouterr()
    assert main(["train-draft", "--target", str(target_dir), "--out", str(out), "--prompts", str(prompts),
                 "--heldout", "4", "--max-new-tokens", "24", "--steps", "30", "--batch-size", "2",
                 "--data-dtype", "fp32", "--eval-max-new-tokens", "16", "--resume"]) == 0
    assert "reusing 10 + 4 samples" in capsys.readouterr().out
