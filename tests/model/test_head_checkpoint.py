"""EAGLE heads in the published checkpoint formats: key names, fc.bias rule, d2t, embeddings from
the target, the draft rope_theta rule, and heads that do not fit the target."""

import json

import pytest
import torch

from services.errors import CheckpointError, IncompatibleHead
from services.model.eagle_head import Eagle2Head, Eagle3Head, HeadConfig, build_head
from services.model.head_checkpoint import load_head, save_head
from tests.helpers import HIDDEN, VOCAB, tiny_hf, to_native

EAGLE2_KEYS = {"embed_tokens.weight", "fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
               "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
               "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
               "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
               "layers.0.post_attention_layernorm.weight"}
EAGLE3_KEYS = {"embed_tokens.weight", "fc.weight", "midlayer.input_layernorm.weight",
               "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
               "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
               "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
               "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
               "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.fixture(scope="module")
def target2():
    return to_native(tiny_hf("llama", layers=2, seed=4))


@pytest.fixture(scope="module")
def target8():
    return to_native(tiny_hf("llama", layers=8, seed=5))


def randomize(head):
    g = torch.Generator().manual_seed(0)
    for p in head.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    return head


def eagle2(target, **kw):
    return randomize(build_head(HeadConfig("eagle", HIDDEN, 128, 4, 2, 1e-6, VOCAB, **kw), target.lm_head))


def eagle3(draft_vocab=96):
    head = randomize(build_head(HeadConfig("eagle3", HIDDEN, 128, 4, 2, 1e-6, VOCAB, draft_vocab_size=draft_vocab)))
    if draft_vocab < VOCAB:
        used = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:draft_vocab]).values
        head.d2t = used - torch.arange(draft_vocab)
        head.t2d = torch.zeros(VOCAB, dtype=torch.bool)
        head.t2d[used] = True
    return head


def same_outputs(a, b, width):
    feats, ids = torch.randn(5, width), torch.randint(0, VOCAB, (5,))
    return torch.equal(a(feats, ids, a.new_cache(8)), b(feats, ids, b.new_cache(8)))


def test_state_dict_keys_are_the_reference_names(target2):
    assert set(eagle2(target2).state_dict()) == EAGLE2_KEYS
    assert set(eagle2(target2, fc_bias=False).state_dict()) == EAGLE2_KEYS - {"fc.bias"}
    assert set(eagle3().state_dict()) == EAGLE3_KEYS
    assert set(eagle3(VOCAB).state_dict()) == EAGLE3_KEYS - {"d2t", "t2d"}


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("bias", [True, False])
def test_eagle2_roundtrip(tmp_path, target2, fmt, bias):
    head = eagle2(target2, fc_bias=bias)
    save_head(head, tmp_path, fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["bias"] is bias and cfg["num_hidden_layers"] == 1
    loaded = load_head(tmp_path, target2)
    assert isinstance(loaded, Eagle2Head)
    assert same_outputs(head, loaded, HIDDEN)


def test_bias_flag_mismatch_names_fc_bias(tmp_path, target2):
    save_head(eagle2(target2, fc_bias=True), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["bias"] = False  # a LLaMA3-style config with a checkpoint that has fc.bias
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="fc.bias"):
        load_head(tmp_path, target2)


def test_missing_embeddings_are_copied_from_the_target(tmp_path, target2):
    head = eagle2(target2)
    save_head(head, tmp_path, "bin")
    state = torch.load(tmp_path / "pytorch_model.bin")
    del state["embed_tokens.weight"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = load_head(tmp_path, target2)
    assert torch.equal(loaded.embed_tokens.weight, target2.model.embed_tokens.weight)


def test_eagle3_roundtrip_with_d2t_and_serving_prefix(tmp_path, target8):
    head = eagle3()
    save_head(head, tmp_path, "safetensors")
    loaded = load_head(tmp_path, target8)
    assert isinstance(loaded, Eagle3Head)
    assert torch.equal(loaded.d2t, head.d2t)
    assert same_outputs(head, loaded, 3 * HIDDEN)
    ids = torch.arange(96)
    assert torch.equal(loaded.to_target(ids), torch.nonzero(head.t2d).flatten())
    # serving frameworks' `layers.0.` prefix is accepted for EAGLE-3 too
    from safetensors.torch import load_file, save_file
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    save_file(state, tmp_path / "model.safetensors")
    assert same_outputs(head, load_head(tmp_path, target8), 3 * HIDDEN)


def test_draft_rope_theta_is_its_own_else_10000(tmp_path):
    target = to_native(tiny_hf("llama", layers=2, seed=6, rope_theta=500000.0))
    head = eagle2(target)
    save_head(head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_head(tmp_path, target)
    assert loaded.config.rope_theta == 10000.0  # not the target's 500000
    cfg["rope_theta"] = 123456.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_head(tmp_path, target).config.rope_theta == 123456.0


def test_heads_that_do_not_fit_the_target(tmp_path, target2):
    wide = randomize(build_head(HeadConfig("eagle", 2 * HIDDEN, 128, 4, 2, 1e-6, VOCAB),
                                torch.nn.Linear(2 * HIDDEN, VOCAB)))
    save_head(wide, tmp_path / "wide")
    with pytest.raises(IncompatibleHead, match="hidden_size 128 does not match the target's 64"):
        load_head(tmp_path / "wide", target2)
    other_vocab = randomize(build_head(HeadConfig("eagle", HIDDEN, 128, 4, 2, 1e-6, 200), target2.lm_head))
    save_head(other_vocab, tmp_path / "vocab")
    with pytest.raises(IncompatibleHead, match="vocab_size 200"):
        load_head(tmp_path / "vocab", target2)
    save_head(eagle3(), tmp_path / "e3")
    with pytest.raises(IncompatibleHead, match="at least 7 layers"):
        load_head(tmp_path / "e3", target2)


def test_missing_and_malformed_head_checkpoints(tmp_path, target2):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_head(tmp_path / "nope", target2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_head(tmp_path / "empty", target2)
    save_head(eagle2(target2), tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_head(tmp_path / "h", target2)
    save_head(eagle2(target2), tmp_path / "t")
    (tmp_path / "t" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_head(tmp_path / "t", target2)
    save_head(eagle2(target2), tmp_path / "w")
    (tmp_path / "w" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither pytorch_model.bin nor model.safetensors"):
        load_head(tmp_path / "w", target2)


def test_token_counts_round_trip_and_restrict_at_load(tmp_path, target2, target8):
    """The frequency map travels with the head directory: save_head writes it, load_head reads it
    and (draft_vocab=K) projects onto the K most frequent tokens, mapped back with d2t."""
    from services.model.draft_vocab import COUNTS_FILE

    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(2))
    head = eagle2(target2)
    head.token_counts = counts
    save_head(head, tmp_path / "h2")
    assert (tmp_path / "h2" / COUNTS_FILE).is_file()
    full = load_head(tmp_path / "h2", target2, draft_vocab=0)
    assert torch.equal(full.token_counts, counts) and full.draft_vocab_size == VOCAB
    small = load_head(tmp_path / "h2", target2, draft_vocab=16)
    top16 = sorted(torch.sort(-counts, stable=True).indices[:16].tolist())
    assert small.draft_vocab_size == 16
    assert small.to_target(torch.arange(16)).tolist() == top16
    out = torch.randn(3, HIDDEN)
    torch.testing.assert_close(small.log_probs(out).exp().sum(-1), torch.ones(3))
    torch.testing.assert_close(small.logits(out), target2.lm_head(out)[:, top16])
    # the reduced projection is derived: saving the loaded head writes the original checkpoint
    save_head(small, tmp_path / "again")
    again = load_head(tmp_path / "again", target2, draft_vocab=0)
    assert same_outputs(full, again, HIDDEN)
    assert torch.equal(again.token_counts, counts)
    # default: a head with counts drafts from DEFAULT_DRAFT_VOCAB (>= V here: the full vocabulary)
    assert load_head(tmp_path / "h2", target2).draft_vocab_size == VOCAB
    # EAGLE-3 with its own 96-token vocabulary: K restricts within it
    h3 = eagle3(96)
    h3.token_counts = counts
    save_head(h3, tmp_path / "h3")
    r3 = load_head(tmp_path / "h3", target8, draft_vocab=10)
    own = set(h3.to_target(torch.arange(96)).tolist())
    kept = r3.to_target(torch.arange(10)).tolist()
    assert set(kept) <= own and len(kept) == 10
    assert kept == sorted(sorted(own, key=lambda t: (-int(counts[t]), t))[:10])


def test_draft_vocab_without_counts_names_the_command(tmp_path, target2):
    save_head(eagle2(target2), tmp_path)
    with pytest.raises(CheckpointError, match="aerie draft-vocab"):
        load_head(tmp_path, target2, draft_vocab=8)
    from services.errors import InvalidRequest
    with pytest.raises(InvalidRequest, match="got -1"):
        load_head(tmp_path, target2, draft_vocab=-1)
