"""`load_target` refuses broken checkpoints with a CheckpointError that names what is wrong."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.errors import CheckpointError
from services.model.loading import load_target


@pytest.fixture
def model_dir(tiny, tmp_path):
    """A valid tiny Llama checkpoint directory (untied, safetensors)."""
    _, path = tiny.saved_model("llama_gqa", tmp_path / "ckpt")
    load_target(str(path))  # sanity: it loads before the test breaks it
    return path


def rewrite_weights(model_dir, edit) -> None:
    file = model_dir / "model.safetensors"
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file), metadata={"format": "pt"})


def test_missing_directory(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        load_target(str(missing))


def test_missing_config_json(model_dir) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=f"{re.escape(str(model_dir))}.*config.json"):
        load_target(str(model_dir))


def test_malformed_config_json(model_dir) -> None:
    (model_dir / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(str(model_dir))


def test_config_missing_a_field(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        load_target(str(model_dir))


def test_unsupported_architecture(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_target(str(model_dir))


def test_no_weights(model_dir) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=f"{re.escape(str(model_dir))}.*no weights"):
        load_target(str(model_dir))


def test_wrong_shaped_tensor(model_dir) -> None:
    key = "model.layers.1.self_attn.k_proj.weight"  # [2 kv heads * 16, 64]
    rewrite_weights(model_dir, lambda s: s.__setitem__(key, torch.zeros(16, 64)))
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)}.*model\.safetensors.*\[16, 64\].*\[32, 64\]"):
        load_target(str(model_dir))


def test_missing_tensor(model_dir) -> None:
    key = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(model_dir, lambda s: s.pop(key))
    with pytest.raises(CheckpointError, match=re.escape(key)):
        load_target(str(model_dir))


def test_missing_lm_head_when_untied(model_dir) -> None:
    rewrite_weights(model_dir, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*tie_word_embeddings"):
        load_target(str(model_dir))


def test_unexpected_tensor(model_dir) -> None:
    key = "model.layers.0.self_attn.q_norm.weight"
    rewrite_weights(model_dir, lambda s: s.__setitem__(key, torch.ones(16)))
    with pytest.raises(CheckpointError, match=re.escape(key)):
        load_target(str(model_dir))


def test_truncated_safetensors(model_dir) -> None:
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(str(file))):
        load_target(str(model_dir))


def test_garbage_safetensors(model_dir) -> None:
    file = model_dir / "model.safetensors"
    file.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=re.escape(str(file))):
        load_target(str(model_dir))


def test_corrupt_pytorch_bin(tiny, tmp_path) -> None:
    path = tiny.save_torch_bin(tiny.hf_model("llama_gqa"), tmp_path / "bin")
    load_target(str(path))
    file = path / "pytorch_model.bin"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=re.escape(str(file))):
        load_target(str(path))


def test_shard_index_naming_a_missing_shard(tiny, tmp_path) -> None:
    path = tiny.save_hf_model(tiny.hf_model("llama_gqa"), tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=re.escape(shard)):
        load_target(str(path))


def test_broken_tokenizer_is_an_error_not_none(model_dir) -> None:
    (model_dir / "tokenizer.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_target(str(model_dir))


def test_a_file_that_is_not_gguf(tmp_path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=re.escape(str(file))):
        load_target(str(file))
