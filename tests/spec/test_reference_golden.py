"""aerie equals the official EAGLE reference (SafeAILab/EAGLE @ cb7e084) in fp32, on goldens.

`golden/reference_trees.json` holds only seeds, shapes and the reference's outputs;
`scripts/reference_golden.py` (which produced them by running the reference code under
transformers 4.53, see its docstring) rebuilds the identical weights and inputs from the seeds with
plain torch, and a SHA-256 digest guards that they are the same bits as when the goldens were made.

  * tree builder: the reference's `topK_genrate` (EAGLE-1/2 head with the target lm_head, and an
    EAGLE-3 head with a 96-of-128 draft vocabulary and d2t), 4 rounds that extend the draft's
    committed KV, shapes (total_token, depth, top_k) = (60,5,10), (16,3,4), (8,7,1), (6,2,2):
    draft tokens, retrieve_indices (= paths; greedy leaf order and the sampling lexicographic order),
    tree mask and tree_position_ids (= depths) are equal;
  * full greedy generation: the reference's `eagenerate` on a tiny peaked Llama with a
    pass-through EAGLE-2 head: per-round accepted tokens (accept_length + 1) and the tokens equal
    aerie's Engine (aerie stops at max_new_tokens, the reference after it: common rounds compared).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.model.config import ModelConfig
from services.model.eagle_head import build_head
from services.model.head_checkpoint import head_config_from_dict
from services.model.target import TargetModel
from services.spec.tree import TreeParams, grow_tree

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((Path(__file__).parent / "golden" / "reference_trees.json").read_text())


def _load_generator():
    spec = importlib.util.spec_from_file_location("reference_golden", ROOT / "scripts" / "reference_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rg = _load_generator()
DIGEST_HINT = ("the seeded weights/inputs differ from those the goldens were made with (generator code "
               "or torch RNG changed): regenerate with scripts/reference_golden.py (see its docstring)")


def _mask_rows(mask: torch.Tensor) -> list[str]:
    return ["".join("1" if x else "0" for x in row) for row in mask.bool().tolist()]


def _tree_head(spec: dict, state: dict[str, torch.Tensor], lm_head_weight: torch.Tensor | None):
    """aerie's head from the same config.json dict the reference was built from."""
    cfg = head_config_from_dict(rg.head_config_dict(spec), state)
    lm_head = None
    if lm_head_weight is not None:
        lm_head = torch.nn.Linear(spec["hidden"], spec["vocab"], bias=False).requires_grad_(False)
        lm_head.weight.copy_(lm_head_weight)
    head = build_head(cfg, lm_head)
    head.load_state_dict(state, strict=True)
    return head.float().eval().requires_grad_(False)


@pytest.mark.parametrize("case", GOLDEN["trees"], ids=[c["spec"]["name"] for c in GOLDEN["trees"]])
def test_tree_builder_equals_reference_topK_genrate(case):
    spec = case["spec"]
    assert rg.tree_case_digest(spec) == case["digest"], DIGEST_HINT
    state, lm_head_weight, rounds = rg.head_state(spec)
    head = _tree_head(spec, state, lm_head_weight)
    params = TreeParams(spec["top_k"], spec["depth"], spec["total_tokens"])
    for sort_paths in (False, True):
        cache = head.new_cache(sum(spec["rounds"]) + params.draft_rows)
        committed = 0
        for r, rd in enumerate(rounds):
            with torch.no_grad():
                tree = grow_tree(head, cache, rd["features"], rd["tokens"], params, sort_paths)
            committed += len(rd["tokens"])
            assert cache.length == committed, "the draft KV keeps only committed rows"
            ref = case["greedy"][r]
            where = f"{spec['name']} round {r} ({'sampling' if sort_paths else 'greedy'} path order)"
            assert tree.tokens.tolist() == ref["tokens"], where
            assert tree.depths.tolist() == ref["depths"], where
            assert _mask_rows(tree.mask) == ref["mask"], where
            expected_paths = case["sampling_retrieve_indices"][r] if sort_paths else ref["retrieve_indices"]
            assert tree.paths.tolist() == expected_paths, where


@pytest.fixture(scope="module")
def greedy_models():
    return build_greedy_models()


def build_greedy_models():
    """(target, head) of the greedy golden case, fp32 on the CPU (tests/gpu moves them to CUDA)."""
    g = GOLDEN["greedy"]
    case = g["case"]
    assert rg.greedy_case_digest(case) == g["digest"], DIGEST_HINT
    tstate = rg.target_state(case["target"])
    target = TargetModel(ModelConfig.from_hf_dict(rg.target_config_dict(case["target"])))
    target.load_state_dict(tstate, strict=True)
    target = target.float().eval().requires_grad_(False)
    hstate = rg.greedy_head_state(case)
    # the published head has no embed_tokens.weight: loaders copy the target's (reference: load_emb)
    hstate["embed_tokens.weight"] = tstate["model.embed_tokens.weight"]
    head = build_head(head_config_from_dict(rg.greedy_head_config_dict(case), hstate), target.lm_head)
    head.load_state_dict(hstate, strict=True)
    return target, head.float().eval().requires_grad_(False)


@pytest.mark.parametrize("run", GOLDEN["greedy"]["runs"],
                         ids=[f"t{r['shape'][0]}_d{r['shape'][1]}_k{r['shape'][2]}_p{i % 3}"
                              for i, r in enumerate(GOLDEN["greedy"]["runs"])])
def test_greedy_rounds_equal_reference_eagenerate(greedy_models, run):
    target, head = greedy_models
    total, depth, top_k = run["shape"]
    max_new = GOLDEN["greedy"]["case"]["max_new_tokens"]
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, TreeParams(top_k, depth, total)),
                    target.config.max_context, target.config.vocab_size, ())
    tokens, accepts = [], []
    for step in engine.generate(GenerationRequest(tuple(run["prompt"]), max_new_tokens=max_new,
                                                  ignore_eos=True)):
        tokens += step.tokens
        if step.stats.round_index > 0:
            accepts.append(step.stats.accept_length)
    assert len(tokens) == max_new
    # the reference runs until new_token > max_new_tokens: it has at least as many rounds and tokens
    assert accepts == run["accept_lengths"][: len(accepts)]
    assert tokens == run["tokens"][: len(tokens)]


def test_greedy_golden_is_meaningful():
    """Rounds accepting several tokens, over several tree shapes: otherwise equality says little."""
    accepts = [a for run in GOLDEN["greedy"]["runs"] for a in run["accept_lengths"]]
    assert max(accepts) >= 5 and sum(a > 1 for a in accepts) > len(accepts) // 2
    assert {tuple(r["shape"]) for r in GOLDEN["greedy"]["runs"]} >= {(60, 5, 10), (16, 3, 4)}
