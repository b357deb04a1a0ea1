"""Tensor parallelism (services/model/tp.py): TP=N greedy == TP=1 token for token in fp32 over gloo,
with N real local processes each loading only its shard from the saved checkpoint; the tree
forward's logits, hidden states and EAGLE-3 taps match; bad group sizes are clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.dist.group import free_address
from services.model.config import ModelConfig
from services.model.loading import load_target
from services.model.tp import TPPlan, TPShapeError, shard_tensor
from tests.model.tp_worker import run

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "3,17,29,4,88,12"


def run_group(model_dir: Path, world: int, out: Path, layout: str = "both:2") -> dict:
    address = free_address()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.model.tp_worker", "--rank", str(r), "--world", str(world),
                               "--address", address, "--model", str(model_dir), "--out", str(out),
                               "--prompt", PROMPT, "--layout", layout],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = [p.communicate(timeout=180)[0].decode()[-2000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    return torch.load(out)


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
@pytest.mark.parametrize("spec,world", [("llama_gqa", 2), ("qwen2_bias", 2), ("tied_smollm2", 2),
                                        ("llama_gqa", 4)])
def test_tp_equals_tp1(tiny, tmp_path, spec, world):
    """llama_gqa at TP=4 has 2 KV heads: each is replicated on two ranks. tied_smollm2 ties the
    vocabulary-parallel embedding and lm_head. qwen2_bias has q/k/v biases."""
    _, model_dir = tiny.saved_model(spec, tmp_path / spec)
    reference = run(load_target(str(model_dir)).model, [int(x) for x in PROMPT.split(",")], 8)
    got = run_group(model_dir, world, tmp_path / "out.pt", "transposed" if world == 4 else "onednn")
    assert got["tokens"] == reference["tokens"]
    cfg = tiny.make_config(spec)
    assert got["kv_heads"] == max(1, cfg.num_key_value_heads // world)  # this rank's KV heads only
    for key in ("logits", "hidden", "taps"):
        assert got[key].shape == reference[key].shape, key
        torch.testing.assert_close(got[key], reference[key], atol=1e-4, rtol=1e-4)


def cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64)
    return ModelConfig(**{**base, **kw})


def test_plan_shapes():
    p = TPPlan.for_config(cfg(), 1, 2)
    assert (p.num_heads, p.num_kv_heads, p.kv_first, p.intermediate, p.vocab_sizes) == (4, 1, 1, 48, (50, 50))
    # 8 ranks, 2 KV heads: ranks 0-3 hold KV head 0, ranks 4-7 KV head 1 (their query heads' group)
    assert [TPPlan.for_config(cfg(), r, 8).kv_first for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # a vocabulary that does not divide: the last shard is shorter
    assert TPPlan.for_config(cfg(vocab_size=101), 0, 2).vocab_sizes == (51, 50)


@pytest.mark.parametrize("world,kw,message", [
    (3, {}, "does not divide the model's 8 attention heads"),
    (4, dict(num_kv_heads=3, num_heads=12), "neither divides the model's 3 KV heads"),
    (2, dict(intermediate_size=97), "intermediate size 97"),
    (0, {}, "is not valid"),
])
def test_bad_group_sizes_are_clear_errors(world, kw, message):
    with pytest.raises(TPShapeError, match=message):
        TPPlan.for_config(cfg(**kw), 0, world)


def test_shard_tensor_slices_each_part():
    p = TPPlan.for_config(cfg(), 1, 2)
    w = torch.arange(64 * 64).view(64, 64)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.q_proj.weight", w, p), w[32:64])
    kv = torch.arange(16 * 64).view(16, 64)
    assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.weight", kv, p), kv[8:16])
    assert torch.equal(shard_tensor("model.layers.0.self_attn.o_proj.weight", w, p), w[:, 32:64])
    assert shard_tensor("model.layers.1.mlp.down_proj.weight", torch.ones(64, 96), p).shape == (64, 48)
    assert shard_tensor("model.layers.1.mlp.up_proj.weight", torch.ones(96, 64), p).shape == (48, 64)
    assert shard_tensor("lm_head.weight", torch.ones(100, 64), p).shape == (50, 64)
    assert shard_tensor("model.norm.weight", torch.ones(64), p).shape == (64,)
