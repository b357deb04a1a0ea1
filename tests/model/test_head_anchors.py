"""load_head_anchors (services/model/loading.py): the drafter service's load of its target reads only
the embedding and the lm_head; every other parameter stays on the meta device (no memory). The head
loaded over them drafts the trees it drafts over the whole target, and its service's load
(build_local_head) never loads the whole target."""

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.local import build_local_engine, build_local_head
from services.errors import CheckpointError
from services.model import loading
from services.model.head_checkpoint import load_head, save_head
from services.model.loading import load_head_anchors, load_target
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, distill_head, tiny_hf, to_native

SHAPE = TreeParams(4, 3, 16)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    """(target dir, head dir) of a tiny Llama, its lm_head its own or the embedding's."""
    hf = tiny_hf("llama", layers=2, seed=3, tie_word_embeddings=request.param)
    root = tmp_path_factory.mktemp("anchors")
    hf.save_pretrained(root / "target")
    save_head(distill_head(to_native(hf), "eagle", seed=3), root / "head")
    return root / "target", root / "head"


def test_only_the_embedding_and_the_lm_head_are_loaded(checkpoint):
    target_dir, _ = checkpoint
    full = load_target(str(target_dir)).model
    anchors = load_head_anchors(str(target_dir)).model
    assert torch.equal(anchors.model.embed_tokens.weight, full.model.embed_tokens.weight)
    x = torch.randn(3, full.config.hidden_size)
    assert torch.equal(anchors.lm_head(x), full.lm_head(x))  # the same layout, the same logits
    real = {n for n, p in anchors.named_parameters() if not p.is_meta}
    assert real <= {"model.embed_tokens.weight", "lm_head.weight"} and "model.embed_tokens.weight" in real
    body = [n for n, p in anchors.named_parameters() if n.startswith("model.layers.")]
    assert body and all(p.is_meta for n, p in anchors.named_parameters() if n in body)
    assert anchors.config == full.config and anchors.device == full.device and anchors.dtype == full.dtype


def test_a_head_over_the_anchors_drafts_the_trees_of_the_whole_target(checkpoint):
    target_dir, head_dir = checkpoint
    heads = [load_head(str(head_dir), loader(str(target_dir)).model) for loader in (load_target, load_head_anchors)]
    drafters = [Drafter(h, SHAPE) for h in heads]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (9,), generator=g)
    features = torch.randn(9, heads[0].config.feature_size, generator=g)
    for d in drafters:
        d.start("s", 64, sampling=False)
    trees = [d.draft("s", tokens, features, SHAPE) for d in drafters]
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)


def test_the_drafter_service_s_load_never_reads_the_whole_target(checkpoint, monkeypatch):
    target_dir, head_dir = checkpoint
    whole = build_local_engine(str(target_dir), str(head_dir), "fp32", SHAPE)
    monkeypatch.setattr(loading, "load_model_dir", lambda *a, **k: pytest.fail("the whole target was loaded"))
    local = build_local_head(str(target_dir), str(head_dir), "fp32")
    assert local.draft_path == str(head_dir) and local.max_context == whole.engine.max_context
    costs = whole.engine.budget.costs
    assert local.costs == (costs.head, costs.logits)  # the same calibration (cached under the same key)


def test_a_torch_bin_checkpoint_gives_the_same_anchors(tmp_path):
    hf = tiny_hf("llama", layers=2, seed=3)
    from safetensors.torch import load_file

    hf.save_pretrained(tmp_path / "safetensors")
    hf.save_pretrained(tmp_path / "bin")  # then the same tensors as a torch .bin, the only weight file there
    weights = tmp_path / "bin" / "model.safetensors"
    torch.save(load_file(str(weights)), tmp_path / "bin" / "pytorch_model.bin")
    weights.unlink()
    a, b = (load_head_anchors(str(tmp_path / d)).model for d in ("safetensors", "bin"))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    x = torch.randn(2, a.config.hidden_size)
    assert torch.equal(a.lm_head(x), b.lm_head(x))


def test_a_checkpoint_without_the_embedding_says_so(tmp_path):
    hf = tiny_hf("llama", layers=2, seed=3)
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop("model.embed_tokens.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors \\['model.embed_tokens.weight'\\]"):
        load_head_anchors(str(tmp_path))
