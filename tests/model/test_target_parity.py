"""The native TargetModel, loaded by `load_target`, against transformers on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from services.model.config import rope_inv_freq
from services.model.loading import load_target

ATOL = 1e-5
SEQ_LEN = {"llama3_rope": 80}  # llama3 scaling changes attention only past the original 32 positions


@pytest.mark.parametrize("spec", ["llama_gqa", "llama3_rope", "qwen2_bias", "tied_smollm2", "mistral"])
def test_logits_and_hidden_match_transformers(tiny, spec: str, tmp_path) -> None:
    hf = tiny.make_hf_model(tiny.make_config(spec))
    loaded = load_target(str(tiny.save_hf_model(hf, tmp_path)))
    ids = tiny.random_ids(SEQ_LEN.get(spec, 24))

    ref_logits, ref_hidden = tiny.hf_forward(hf, ids)
    out = tiny.native_forward(loaded.model, ids)

    assert out.logits.dtype == torch.float32 and out.logits.shape == ref_logits.shape
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, ref_hidden[-1], atol=ATOL, rtol=0)
    assert out.taps is None
    assert loaded.tokenizer is None  # save_pretrained of a bare model writes no tokenizer files
    assert loaded.path == str(tmp_path)
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())


def test_llama3_rope_scaling_is_applied(tiny, tmp_path) -> None:
    """The llama3 case above only proves something if the scaled frequencies differ from plain ones."""
    hf = tiny.make_hf_model(tiny.make_config("llama3_rope"))
    model = load_target(str(tiny.save_hf_model(hf, tmp_path))).model
    cfg = model.config
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_theta == 500000.0
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    assert not torch.allclose(model.rotary.inv_freq, plain)
    torch.testing.assert_close(model.rotary.inv_freq, hf.model.rotary_emb.inv_freq.float())


def test_qwen2_biases_are_loaded(tiny, tmp_path) -> None:
    hf = tiny.make_hf_model(tiny.make_config("qwen2_bias"))
    model = load_target(str(tiny.save_hf_model(hf, tmp_path))).model
    attn = model.model.layers[1].self_attn
    assert model.config.architecture == "qwen2" and model.config.qkv_bias and not model.config.o_bias
    for name in ("q_proj", "k_proj", "v_proj"):
        ours, theirs = attn.qkv_proj.part_bias(name), getattr(hf.model.layers[1].self_attn, name).bias
        assert ours.abs().sum() > 0
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert attn.o_proj.bias is None


def test_tied_embeddings_share_one_tensor(tiny, tmp_path) -> None:
    hf = tiny.make_hf_model(tiny.make_config("tied_smollm2"))
    path = tiny.save_hf_model(hf, tmp_path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # the loader really took the tied path
    model = load_target(str(path), layout="hf").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight, atol=0, rtol=0)
    # the transposed inference layout keeps one [in, out] copy for the head, same values
    model = load_target(str(path), layout="transposed").model
    assert model.lm_head.weight_t is not None and model.lm_head.weight_t.is_contiguous()
    assert model.lm_head.weight.data_ptr() == model.lm_head.weight_t.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight, atol=0, rtol=0)


def test_eagle3_taps_match_hf_hidden_states(tiny, tmp_path) -> None:
    hf = tiny.make_hf_model(tiny.make_config("llama_8layer"))
    model = load_target(str(tiny.save_hf_model(hf, tmp_path))).model
    ids = tiny.random_ids(20)
    _, hs = tiny.hf_forward(hf, ids)
    out = tiny.native_forward(model, ids, want_taps=True)
    n = model.config.num_layers
    assert n == 8 and model.config.eagle3_tap_layers == (2, 4, 5)
    expected = torch.cat([hs[2], hs[n // 2], hs[n - 3]], dim=-1)
    assert out.taps is not None and out.taps.shape == (20, 3 * model.config.hidden_size)
    torch.testing.assert_close(out.taps, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, hs[-1], atol=ATOL, rtol=0)


def test_prefill_then_decode_matches_full_forward(tiny, tiny_llama) -> None:
    loaded, _ = tiny_llama
    model = loaded.model
    ids = tiny.random_ids(20, seed=3)
    full = tiny.native_forward(model, ids)

    cache = model.new_cache(32)
    prefill = model(ids[:8], cache)
    steps = [model(ids[i:i + 1], cache, logits_for="last").logits for i in range(8, 20)]
    assert cache.length == 20
    torch.testing.assert_close(prefill.logits, full.logits[:8], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(steps), full.logits[8:], atol=ATOL, rtol=0)


def test_logits_for_last_is_the_last_row(tiny, tiny_llama) -> None:
    loaded, _ = tiny_llama
    ids = tiny.random_ids(12, seed=4)
    full = tiny.native_forward(loaded.model, ids)
    last = loaded.model(ids, loaded.model.new_cache(12), logits_for="last")
    assert last.logits.shape == (1, full.logits.shape[1])
    torch.testing.assert_close(last.logits, full.logits[-1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["sharded_safetensors", "pytorch_bin", "sharded_pytorch_bin"])
def test_other_weight_layouts_load_identically(tiny, layout: str, tmp_path) -> None:
    hf = tiny.make_hf_model(tiny.make_config("llama_gqa"))
    single = load_target(str(tiny.save_hf_model(hf, tmp_path / "single"))).model
    if layout == "sharded_safetensors":
        path = tiny.save_hf_model(hf, tmp_path / layout, max_shard_size="20KB")
        assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
        index = "model.safetensors.index.json"
    else:
        path = tiny.save_torch_bin(hf, tmp_path / layout, shards=3 if layout == "sharded_pytorch_bin" else 1)
        assert not list(path.glob("*.safetensors"))
        index = "pytorch_model.bin.index.json" if layout == "sharded_pytorch_bin" else None
    if index is not None:
        shards = set(json.loads((path / index).read_text())["weight_map"].values())
        assert len(shards) > 1, "the checkpoint should really be sharded"
    other = load_target(str(path)).model

    assert single.state_dict().keys() == other.state_dict().keys()
    for key, tensor in single.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key], tensor, atol=0, rtol=0, msg=key)
    ids = tiny.random_ids(10)
    torch.testing.assert_close(tiny.native_forward(other, ids).logits, tiny.native_forward(single, ids).logits,
                               atol=0, rtol=0)


def test_bf16_load_is_a_downcast_and_close(tiny, tmp_path) -> None:
    hf = tiny.make_hf_model(tiny.make_config("llama_gqa"))
    path = str(tiny.save_hf_model(hf, tmp_path))
    fp32 = load_target(path).model
    bf16 = load_target(path, dtype=torch.bfloat16).model
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.dtype == torch.bfloat16 and bf16.new_cache(4).k.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.model.embed_tokens.weight,
                               fp32.model.embed_tokens.weight.to(torch.bfloat16), atol=0, rtol=0)
    ids = tiny.random_ids(16)
    ref = tiny.native_forward(fp32, ids).logits
    out = tiny.native_forward(bf16, ids).logits
    assert out.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() < 0.05 * scale
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_rotary_inv_freq_key_in_checkpoint_is_ignored(tiny, tmp_path) -> None:
    """Older Llama checkpoints carry `...rotary_emb.inv_freq`; it holds no weights."""
    from safetensors.torch import load_file, save_file
    hf = tiny.make_hf_model(tiny.make_config("llama_gqa"))
    path = tiny.save_hf_model(hf, tmp_path)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    state["model.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = tiny.random_ids(10)
    torch.testing.assert_close(tiny.native_forward(load_target(str(path)).model, ids).logits,
                               tiny.hf_forward(hf, ids)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["hf", "transposed", "both", "onednn"])
@pytest.mark.parametrize("spec", ["llama_gqa", "qwen2_bias", "tied_smollm2"])
def test_fused_layouts_match_transformers_on_every_path(tiny, spec: str, layout: str, tmp_path) -> None:
    """Fused q/k/v + gate/up in every weight layout, through the three attention paths: maskless
    causal prefill, maskless one-row decode, and a dense-masked chunk after a prefix."""
    hf = tiny.make_hf_model(tiny.make_config(spec))
    model = load_target(str(tiny.save_hf_model(hf, tmp_path)), layout=layout).model
    ids = tiny.random_ids(20)
    ref_logits, ref_hidden = tiny.hf_forward(hf, ids)
    cache = model.new_cache(20)
    pre = model(ids[:12], cache)  # empty cache: no mask (is_causal)
    torch.testing.assert_close(pre.logits, ref_logits[:12], atol=ATOL, rtol=0)
    for i in range(12, 14):  # T == 1: no mask
        step = model(ids[i:i + 1], cache, logits_for="last")
        torch.testing.assert_close(step.logits[0], ref_logits[i], atol=ATOL, rtol=0)
    pair = model(ids[14:16], cache)  # 2 rows (onednn: padded to ONEDNN_ROW_STEP rows inside each linear)
    torch.testing.assert_close(pair.logits, ref_logits[14:16], atol=ATOL, rtol=0)
    chunk = model(ids[16:20], cache)  # prefix 16, 4 causal rows: dense mask
    torch.testing.assert_close(chunk.logits, ref_logits[16:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(chunk.hidden, ref_hidden[-1][16:20], atol=ATOL, rtol=0)


def test_packed_weights_keep_hugging_face_names(tiny, tmp_path) -> None:
    """state_dict shows q/k/v and gate/up under their own names (the checkpoint's), and the packed
    module knows each part's rows, so a tensor-parallel transform can slice per projection."""
    hf = tiny.make_hf_model(tiny.make_config("qwen2_bias"))
    model = load_target(str(tiny.save_hf_model(hf, tmp_path)), layout="hf").model
    ours, theirs = model.state_dict(), hf.state_dict()
    assert set(ours) - {"lm_head.weight"} == set(theirs) - {"lm_head.weight"}
    for k, v in theirs.items():
        torch.testing.assert_close(ours[k], v, atol=0, rtol=0)
    attn = model.model.layers[0].self_attn
    c = model.config
    assert attn.qkv_proj.splits == (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                     c.num_kv_heads * c.head_dim)
    assert attn.qkv_proj.parts()["v_proj"] == (attn.qkv_proj.splits[0] + attn.qkv_proj.splits[1],
                                               attn.qkv_proj.splits[2])
    torch.testing.assert_close(attn.qkv_proj.part_weight("k_proj"), hf.model.layers[0].self_attn.k_proj.weight,
                               atol=0, rtol=0)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_up_proj.names == ("gate_proj", "up_proj")
    torch.testing.assert_close(mlp.gate_up_proj.part_weight("up_proj"), hf.model.layers[0].mlp.up_proj.weight,
                               atol=0, rtol=0)


def test_onednn_layout_packs_on_the_cpu_and_falls_back_elsewhere() -> None:
    from services.model.linear import Linear

    torch.manual_seed(0)
    ref = Linear(24, 40)
    x = torch.randn(7, 24)
    for rows in (1, 2, 3, 7):
        lin = Linear(24, 40)
        lin.load_state_dict(ref.state_dict())
        lin.freeze("onednn", 1)
        assert lin.weight_packed is not None and lin.weight.shape == (40, 24)
        torch.testing.assert_close(lin(x[:rows]), ref(x[:rows]), atol=1e-5, rtol=0)
    wide = Linear(24, 40).double()  # no oneDNN kernel for fp64: the "both" layout, same numbers
    wide.freeze("onednn", 1)
    assert wide.weight_packed is None and wide.weight_t is not None and wide.max_rows_t == 1
    torch.testing.assert_close(wide(x.double()), F.linear(x.double(), wide.weight, wide.bias))
