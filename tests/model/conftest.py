"""Tiny random-weight Hugging Face models for the target-model tests.

Tests reach the helpers through the `tiny` fixture (`tiny.hf_model("llama_gqa")`), not by importing
this file, so they run under any pytest import mode and beside other conftest.py files.

Every builder seeds torch, makes all weights random (including RMSNorm scales and q/k/v biases,
which transformers initialises to constants that would hide a mis-loaded tensor) and saves the
model with `save_pretrained`, so `load_target` reads exactly what a real checkpoint looks like.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from services.model.loading import LoadedTarget, load_target
from services.model.target import TargetModel

torch.set_num_threads(1)

VOCAB = 160
BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (config class, overrides) of the tiny models the tests build.
SPECS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama_gqa": (LlamaConfig, dict(num_hidden_layers=3, num_key_value_heads=2)),
    "llama3_rope": (LlamaConfig, dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen2_bias": (Qwen2Config, dict(num_key_value_heads=2, rope_theta=1000000.0)),
    "tied_smollm2": (LlamaConfig, dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                       hidden_size=64, rope_theta=100000.0, tie_word_embeddings=True)),
    "mistral": (MistralConfig, dict(num_key_value_heads=1, sliding_window=None)),
    "llama_8layer": (LlamaConfig, dict(num_hidden_layers=8, num_key_value_heads=2)),
}


def make_config(spec: str, **overrides: Any) -> PretrainedConfig:
    cls, spec_overrides = SPECS[spec]
    return cls(**{**BASE, **spec_overrides, **overrides})


def make_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A fp32 transformers CausalLM with every parameter random (norms near 1, biases nonzero)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(model: torch.nn.Module, path: Path, **kwargs: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), **kwargs)
    return path


def save_torch_bin(model: torch.nn.Module, path: Path, shards: int = 1) -> Path:
    """Write the legacy `pytorch_model.bin` layout (transformers 5 only writes safetensors):
    config.json plus one .bin, or `shards` .bin files and a `pytorch_model.bin.index.json`."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(path))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return path
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i::shards]}
        torch.save(part, path / name)
        weight_map.update(dict.fromkeys(part, name))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@torch.no_grad()
def hf_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(logits [T, V] fp32, hidden_states: embeddings, inputs of layers 1..N-1, post-norm output)."""
    out = model(ids[None], output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), tuple(h[0] for h in out.hidden_states)


def native_forward(model: TargetModel, ids: torch.Tensor, want_taps: bool = False):
    """One full causal forward on a fresh cache."""
    return model(ids, model.new_cache(ids.shape[0]), want_taps=want_taps)


def random_ids(n: int, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


def hf_model(spec: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    return make_hf_model(make_config(spec, **overrides), seed)


def saved_model(spec: str, path: Path, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, Path]:
    """(HF model, directory it was saved to)."""
    model = hf_model(spec, seed, **overrides)
    return model, save_hf_model(model, path)


@pytest.fixture(scope="session")
def tiny() -> SimpleNamespace:
    return SimpleNamespace(
        VOCAB=VOCAB, ATOL=1e-5, SPECS=SPECS, make_config=make_config, make_hf_model=make_hf_model,
        hf_model=hf_model, save_hf_model=save_hf_model, save_torch_bin=save_torch_bin, saved_model=saved_model, hf_forward=hf_forward,
        native_forward=native_forward, random_ids=random_ids)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedTarget, torch.nn.Module]:
    """A GQA Llama (3 layers) saved as safetensors and loaded natively, with its HF twin."""
    hf = make_hf_model(make_config("llama_gqa"))
    path = save_hf_model(hf, tmp_path_factory.mktemp("tiny_llama"))
    return load_target(str(path)), hf
