"""Cross-check aerie against the official EAGLE reference implementation (SafeAILab/EAGLE) in fp32,
and (re)generate the golden file `tests/spec/golden/reference_trees.json`.

What is compared (eagle.md sections 2-5, 9):
  * tree builder: the reference's `Model.topK_genrate` (cnets1.py for EAGLE-1/2 heads, cnets.py for
    EAGLE-3 heads with a reduced draft vocabulary and d2t) against aerie's `grow_tree`, over several
    rounds that extend the draft's committed KV; draft tokens, retrieve_indices (= aerie's paths),
    tree mask and tree_position_ids (= depths) must be equal, greedy and sampling path order both;
  * full greedy generation: the reference's `EaModel.eagenerate` (its own KV-cache Llama target,
    `tree_decoding`, `evaluate_posterior`, `update_inference_inputs`) against aerie's `Engine`, in
    process and through `aerie generate`: per-round accept lengths and tokens must be equal.

The reference needs transformers 4.53.x and aerie needs transformers 5, so the work is split into
stages that talk through files in a work directory:

    inputs     (any Python with torch)  seeded weights and inputs -> safetensors/json, published-format
                                        head directories
    reference  (the reference's venv)   runs the reference code, imported from --eagle-repo; saves the
                                        tiny target as a Hugging Face directory with save_pretrained
    aerie      (aerie's venv)           runs aerie on the same files, in process and via the CLI
    compare    (aerie's venv)           exact comparison; exit 1 on any mismatch
    golden     (aerie's venv)           writes the golden JSON (seeds, shapes, reference outputs only)
    all        (aerie's venv)           all of the above, running `reference` with --ref-python

Weights and inputs come from `torch.Generator` draws in a fixed order and shapes (uniform
distributions with the stated standard deviations, drawn in float64 and rounded to float32, so the
bits are the same on every CPU), independent of any module construction. The golden test
(`tests/spec/test_reference_golden.py`) imports this file to rebuild them from the seeds and checks a
SHA-256 digest of the tensors before comparing trees.

Regenerating the goldens (only needed when the cases below change):

    # 1. the reference: a checkout (or `git archive`) of SafeAILab/EAGLE at cb7e084, used read-only
    git clone https://github.com/SafeAILab/EAGLE /tmp/EAGLE && git -C /tmp/EAGLE checkout cb7e084
    # 2. a separate venv for it (torch first, then transformers 4.53.x)
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0
    /tmp/refvenv/bin/pip install transformers==4.53.3 accelerate safetensors huggingface_hub
    # 3. everything, from aerie's venv
    .venv/bin/python scripts/reference_golden.py all --eagle-repo /tmp/EAGLE \\
        --ref-python /tmp/refvenv/bin/python --work /tmp/aerie_refcheck --write-golden
    # (for an extracted copy that is not a git checkout, add --eagle-commit <full hash> so that the
    #  golden records which commit it came from)

Nothing of the reference is copied into this repository; it is imported at run time from
--eagle-repo. The reference needs no tokenizer here: `EaModel` loads one only to read `eos_token_id`,
so the harness substitutes a stub without EOS (aerie runs with --ignore-eos to match).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REFERENCE_COMMIT = "cb7e084"
GOLDEN_PATH = Path(__file__).resolve().parents[1] / "tests" / "spec" / "golden" / "reference_trees.json"

# ---------------------------------------------------------------------------------------------
# Cases. Tree shapes are (total_token, depth, top_k) as the reference's EaModel takes them.

TREE_SHAPES = [(60, 5, 10), (16, 3, 4), (8, 7, 1), (6, 2, 2)]
# Rows each topK_genrate call commits: the prefill's prompt rows, then accepted + bonus per round.
TREE_ROUNDS = [9, 4, 1, 6]


def tree_cases() -> list[dict]:
    cases = []
    for i, (t, d, k) in enumerate(TREE_SHAPES):
        cases.append(dict(
            name=f"eagle2_t{t}_d{d}_k{k}", kind="eagle", seed=1000 + i, total_tokens=t, depth=d, top_k=k,
            hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, rms_eps=1e-6,
            # one case each with a non-default rope_theta and without fc.bias (LLaMA3-style heads)
            rope_theta=500000.0 if i == 1 else 10000.0, fc_bias=i != 2,
            w_std=0.1, embed_std=1.0, norm_std=0.1, lm_std=0.3, feat_std=1.0, rounds=TREE_ROUNDS))
    for i, (t, d, k) in enumerate(TREE_SHAPES):
        cases.append(dict(
            name=f"eagle3_t{t}_d{d}_k{k}", kind="eagle3", seed=2000 + i, total_tokens=t, depth=d, top_k=k,
            hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128, draft_vocab=96, rms_eps=1e-6,
            rope_theta=None if i == 0 else 10000.0,  # None: no rope_theta key (both default to 10000)
            w_std=0.1, embed_std=1.0, norm_std=0.1, lm_std=0.3, feat_std=1.0, rounds=TREE_ROUNDS))
    return cases


GREEDY_CASE = dict(
    name="greedy_llama3l",
    target=dict(seed=3000, layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128,
                rms_eps=1e-6, rope_theta=10000.0, max_pos=512,
                w_std=0.04, embed_std=1.0, final_norm=10.0, lm_std=0.05),
    head=dict(seed=3001, pass_scale=10.0, pass_std=0.1, feat_std=0.05, w_std=0.05, rope_theta=10000.0,
              fc_bias=True),
    prompt_seed=3002, prompts=3, prompt_len=8, max_new_tokens=40,
    shapes=[(60, 5, 10), (16, 3, 4), (8, 7, 1)],
)

# ---------------------------------------------------------------------------------------------
# Seeded generation: plain torch only (this part also runs under the reference's venv and is
# imported by the golden test).


def _u(g: torch.Generator, shape, std: float, mean: float = 0.0) -> torch.Tensor:
    """Uniform with standard deviation `std` around `mean`, bit-identical on every CPU."""
    a = math.sqrt(3.0) * std
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2.0 - 1.0) * a + mean).to(torch.float32)


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def head_config_dict(spec: dict) -> dict:
    """The head's config.json (published format) for a tree case."""
    d = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": spec["hidden"], "intermediate_size": spec["intermediate"],
        "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
        "num_hidden_layers": 1, "rms_norm_eps": spec["rms_eps"], "vocab_size": spec["vocab"],
        "max_position_embeddings": 2048, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }
    if spec.get("rope_theta") is not None:
        d["rope_theta"] = spec["rope_theta"]
    if spec["kind"] == "eagle":
        d["bias"] = bool(spec.get("fc_bias", True))
    else:
        d["draft_vocab_size"] = spec["draft_vocab"]
    return d


def head_state(spec: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[dict]]:
    """(head state dict with the reference's keys, target lm_head weight for EAGLE-1/2 or None,
    rounds) for a tree case. Each round is {"features": [n, F], "tokens": [n]} where tokens are the
    newly committed tokens shifted by one (the last is the new root); round 0 also has "first_id",
    the prompt's first token (the reference's input_ids[:, 0], which the shift drops)."""
    g = torch.Generator().manual_seed(int(spec["seed"]))
    h, i_, v = spec["hidden"], spec["intermediate"], spec["vocab"]
    nh, nkv = spec["heads"], spec["kv_heads"]
    hd = h // nh
    w, ns = spec["w_std"], spec["norm_std"]
    s: dict[str, torch.Tensor] = {}
    s["embed_tokens.weight"] = _u(g, (v, h), spec["embed_std"])
    if spec["kind"] == "eagle":
        s["fc.weight"] = _u(g, (h, 2 * h), w)
        if spec.get("fc_bias", True):
            s["fc.bias"] = _u(g, (h,), w)
        p = "layers.0."
        in_dim = h
    else:
        s["fc.weight"] = _u(g, (h, 3 * h), w)
        p = "midlayer."
        in_dim = 2 * h
    s[p + "self_attn.q_proj.weight"] = _u(g, (nh * hd, in_dim), w)
    s[p + "self_attn.k_proj.weight"] = _u(g, (nkv * hd, in_dim), w)
    s[p + "self_attn.v_proj.weight"] = _u(g, (nkv * hd, in_dim), w)
    s[p + "self_attn.o_proj.weight"] = _u(g, (h, nh * hd), w)
    s[p + "mlp.gate_proj.weight"] = _u(g, (i_, h), w)
    s[p + "mlp.up_proj.weight"] = _u(g, (i_, h), w)
    s[p + "mlp.down_proj.weight"] = _u(g, (h, i_), w)
    if spec["kind"] == "eagle3":
        s[p + "input_layernorm.weight"] = _u(g, (h,), ns, 1.0)
        s[p + "hidden_norm.weight"] = _u(g, (h,), ns, 1.0)
    s[p + "post_attention_layernorm.weight"] = _u(g, (h,), ns, 1.0)
    lm_head = None
    if spec["kind"] == "eagle":
        lm_head = _u(g, (v, h), spec["lm_std"])
        feat = h
    else:
        vd = spec["draft_vocab"]
        s["norm.weight"] = _u(g, (h,), ns, 1.0)
        s["lm_head.weight"] = _u(g, (vd, h), spec["lm_std"])
        used = torch.sort(torch.randperm(v, generator=g)[:vd]).values
        s["d2t"] = used - torch.arange(vd)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[used] = True
        s["t2d"] = t2d
        feat = 3 * h
    rounds = []
    total = sum(spec["rounds"])
    seq = torch.randint(0, v, (total + 1,), generator=g)  # seq[0] is the prompt's first token
    start = 1
    for n in spec["rounds"]:
        rounds.append({"features": _u(g, (n, feat), spec["feat_std"]), "tokens": seq[start:start + n]})
        start += n
    rounds[0]["first_id"] = int(seq[0])
    return s, lm_head, rounds


def tree_case_digest(spec: dict) -> str:
    state, lm_head, rounds = head_state(spec)
    all_ = dict(state)
    if lm_head is not None:
        all_["target.lm_head.weight"] = lm_head
    for r, rd in enumerate(rounds):
        all_[f"round{r}.features"] = rd["features"]
        all_[f"round{r}.tokens"] = rd["tokens"]
    return digest(all_)


def target_config_dict(t: dict) -> dict:
    """A Hugging Face Llama config.json for the greedy case's target."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": t["hidden"], "intermediate_size": t["intermediate"],
        "num_hidden_layers": t["layers"], "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"], "rms_norm_eps": t["rms_eps"], "vocab_size": t["vocab"],
        "max_position_embeddings": t["max_pos"], "rope_theta": t["rope_theta"], "rope_scaling": None,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32",
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
    }


def target_state(t: dict) -> dict[str, torch.Tensor]:
    """A "peaked" random Llama (embeddings of std embed_std, final norm x final_norm), HF names."""
    g = torch.Generator().manual_seed(int(t["seed"]))
    h, i_, v = t["hidden"], t["intermediate"], t["vocab"]
    nh, nkv = t["heads"], t["kv_heads"]
    hd = h // nh
    w = t["w_std"]
    s = {"model.embed_tokens.weight": _u(g, (v, h), t["embed_std"])}
    for layer in range(t["layers"]):
        p = f"model.layers.{layer}."
        s[p + "input_layernorm.weight"] = torch.ones(h)
        s[p + "self_attn.q_proj.weight"] = _u(g, (nh * hd, h), w)
        s[p + "self_attn.k_proj.weight"] = _u(g, (nkv * hd, h), w)
        s[p + "self_attn.v_proj.weight"] = _u(g, (nkv * hd, h), w)
        s[p + "self_attn.o_proj.weight"] = _u(g, (h, nh * hd), w)
        s[p + "post_attention_layernorm.weight"] = torch.ones(h)
        s[p + "mlp.gate_proj.weight"] = _u(g, (i_, h), w)
        s[p + "mlp.up_proj.weight"] = _u(g, (i_, h), w)
        s[p + "mlp.down_proj.weight"] = _u(g, (h, i_), w)
    s["model.norm.weight"] = torch.full((h,), float(t["final_norm"]))
    s["lm_head.weight"] = _u(g, (v, h), t["lm_std"])
    return s


def greedy_head_config_dict(case: dict) -> dict:
    t, hs = case["target"], case["head"]
    spec = dict(kind="eagle", hidden=t["hidden"], intermediate=t["intermediate"], heads=t["heads"],
                kv_heads=t["kv_heads"], rms_eps=t["rms_eps"], vocab=t["vocab"],
                rope_theta=hs["rope_theta"], fc_bias=hs["fc_bias"])
    return head_config_dict(spec)


def greedy_head_state(case: dict) -> dict[str, torch.Tensor]:
    """A "lightly structured" EAGLE-2 head for the greedy case: fc passes the token embedding
    through (x pass_scale, plus noise) so that the draft roughly predicts the target's next feature;
    everything else random. No embed_tokens.weight: loaders copy it from the target."""
    t, hs = case["target"], case["head"]
    g = torch.Generator().manual_seed(int(hs["seed"]))
    h, i_ = t["hidden"], t["intermediate"]
    nh, nkv = t["heads"], t["kv_heads"]
    hd = h // nh
    w = hs["w_std"]
    s = {}
    emb_part = hs["pass_scale"] * torch.eye(h) + _u(g, (h, h), hs["pass_std"])
    s["fc.weight"] = torch.cat([emb_part, _u(g, (h, h), hs["feat_std"])], dim=1)
    if hs["fc_bias"]:
        s["fc.bias"] = _u(g, (h,), w)
    p = "layers.0."
    s[p + "self_attn.q_proj.weight"] = _u(g, (nh * hd, h), w)
    s[p + "self_attn.k_proj.weight"] = _u(g, (nkv * hd, h), w)
    s[p + "self_attn.v_proj.weight"] = _u(g, (nkv * hd, h), w)
    s[p + "self_attn.o_proj.weight"] = _u(g, (h, nh * hd), w)
    s[p + "mlp.gate_proj.weight"] = _u(g, (i_, h), w)
    s[p + "mlp.up_proj.weight"] = _u(g, (i_, h), w)
    s[p + "mlp.down_proj.weight"] = _u(g, (h, i_), w)
    s[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return s


def greedy_prompts(case: dict) -> list[list[int]]:
    g = torch.Generator().manual_seed(int(case["prompt_seed"]))
    return [torch.randint(0, case["target"]["vocab"], (case["prompt_len"],), generator=g).tolist()
            for _ in range(case["prompts"])]


def greedy_case_digest(case: dict) -> str:
    s = {f"target.{k}": v for k, v in target_state(case["target"]).items()}
    s.update({f"head.{k}": v for k, v in greedy_head_state(case).items()})
    s["prompts"] = torch.tensor(greedy_prompts(case))
    return digest(s)


# ---------------------------------------------------------------------------------------------
# Small helpers


def mask_rows(mask: torch.Tensor) -> list[str]:
    """[N, N] 0/1 -> ["100..", "110..", ...]."""
    return ["".join("1" if x else "0" for x in row) for row in mask.bool().tolist()]


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# Stage: inputs


def stage_inputs(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    manifest = {"trees": [], "greedy": None}
    for spec in tree_cases():
        d = work / "trees" / spec["name"]
        d.mkdir(parents=True, exist_ok=True)
        state, lm_head, rounds = head_state(spec)
        _save_tensors(d / "head.safetensors", state)
        _write_json(d / "config.json", head_config_dict(spec))
        extra = {}
        if lm_head is not None:
            extra["lm_head.weight"] = lm_head
        for r, rd in enumerate(rounds):
            extra[f"round{r}.features"] = rd["features"]
            extra[f"round{r}.tokens"] = rd["tokens"]
        extra["first_id"] = torch.tensor([rounds[0]["first_id"]])
        _save_tensors(d / "inputs.safetensors", extra)
        manifest["trees"].append({"spec": spec, "dir": str(d), "digest": tree_case_digest(spec)})
    case = GREEDY_CASE
    d = work / "greedy"
    (d / "head").mkdir(parents=True, exist_ok=True)
    _save_tensors(d / "target_state.safetensors", target_state(case["target"]))
    _write_json(d / "target_config.json", target_config_dict(case["target"]))
    # the head in the published format: config.json + pytorch_model.bin
    _write_json(d / "head" / "config.json", greedy_head_config_dict(case))
    torch.save(greedy_head_state(case), str(d / "head" / "pytorch_model.bin"))
    manifest["greedy"] = {"case": case, "dir": str(d), "target_dir": str(d / "target"),
                          "head_dir": str(d / "head"), "prompts": greedy_prompts(case),
                          "digest": greedy_case_digest(case)}
    _write_json(work / "manifest.json", manifest)
    print(f"inputs: {len(manifest['trees'])} tree cases and 1 greedy case under {work}")


# ---------------------------------------------------------------------------------------------
# Stage: reference (runs under the reference's venv, transformers 4.53.x)


def _import_reference(eagle_repo: Path):
    if not (eagle_repo / "eagle" / "model" / "cnets1.py").is_file():
        raise SystemExit(f"{eagle_repo} does not look like a SafeAILab/EAGLE checkout "
                         f"(no eagle/model/cnets1.py)")
    sys.path.insert(0, str(eagle_repo))
    from eagle.model import cnets, cnets1, ea_model
    from eagle.model import utils as ref_utils
    from eagle.model.configs import EConfig
    return cnets, cnets1, ea_model, ref_utils, EConfig


def _ref_commit(eagle_repo: Path, given: str | None = None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "-C", str(eagle_repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"unknown ({eagle_repo} is not a git checkout; expected {REFERENCE_COMMIT})"


def _ref_tree_case(case: dict, mods) -> dict:
    cnets, cnets1, _, ref_utils, EConfig = mods
    spec = case["spec"]
    d = Path(case["dir"])
    cfg_dict = json.loads((d / "config.json").read_text())
    state = _load_tensors(d / "head.safetensors")
    inputs = _load_tensors(d / "inputs.safetensors")
    config = EConfig(**cfg_dict)
    cls = cnets1.Model if spec["kind"] == "eagle" else cnets.Model
    out = {}
    for mode in ("greedy", "sampling"):
        model = cls(config, bias=cfg_dict.get("bias", True), total_tokens=spec["total_tokens"],
                    depth=spec["depth"], top_k=spec["top_k"])
        model.load_state_dict(state, strict=True)
        model = model.float().eval()
        model.init_tree()
        model.reset_kv()
        head = None
        if spec["kind"] == "eagle":
            head = torch.nn.Linear(spec["hidden"], spec["vocab"], bias=False)
            head.weight.data.copy_(inputs["lm_head.weight"])
        proc = None if mode == "greedy" else ref_utils.prepare_logits_processor(temperature=0.7)
        input_ids = inputs["first_id"].clone()
        rounds = []
        for r in range(len(spec["rounds"])):
            input_ids = torch.cat([input_ids, inputs[f"round{r}.tokens"]])
            hidden = inputs[f"round{r}.features"][None]
            with torch.no_grad():
                tokens, ri, mask, pos = model.topK_genrate(hidden, input_ids[None], head, proc)
            rounds.append({"tokens": tokens[0].tolist(), "retrieve_indices": ri.tolist(),
                           "mask": mask_rows(mask[0, 0]), "depths": pos.tolist()})
        out[mode] = rounds
    return out


class _NoTokenizer:
    """Stands in for the tokenizer `EaModel` loads only to read `eos_token_id` (no EOS here)."""

    eos_token_id = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()


def _save_hf_target(greedy: dict) -> None:
    """The greedy case's target as a Hugging Face directory, via transformers' own save_pretrained
    (sharded, so that the reference's load_emb finds model.safetensors.index.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(greedy["dir"])
    cfg = json.loads((d / "target_config.json").read_text())
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(_load_tensors(d / "target_state.safetensors"), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    model.save_pretrained(greedy["target_dir"], max_shard_size="200KB", safe_serialization=True)
    assert (Path(greedy["target_dir"]) / "model.safetensors.index.json").is_file()


def _ref_hf_greedy(greedy: dict, max_new: int) -> list[list[int]]:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(greedy["target_dir"], torch_dtype=torch.float32).eval()
    outs = []
    for prompt in greedy["prompts"]:
        o = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        outs.append(o[0, len(prompt):].tolist())
    return outs


def _ref_greedy(greedy: dict, mods) -> list[dict]:
    _, _, ea_model, _, _ = mods
    ea_model.AutoTokenizer = _NoTokenizer  # EaModel reads only eos_token_id from it
    case = greedy["case"]
    runs = []
    for (t, dpt, k) in case["shapes"]:
        model = ea_model.EaModel.from_pretrained(
            use_eagle3=False, base_model_path=greedy["target_dir"], ea_model_path=greedy["head_dir"],
            total_token=t, depth=dpt, top_k=k, torch_dtype=torch.float32).eval()
        assert model.base_model.dtype == torch.float32 and model.ea_layer.fc.weight.dtype == torch.float32
        accepts: list[int] = []
        trees: list[list[int]] = []
        orig_eval = ea_model.evaluate_posterior
        orig_topk = model.ea_layer.topK_genrate

        def eval_rec(logits, candidates, lp, _orig=orig_eval, _acc=accepts):
            best, acc, p = _orig(logits, candidates, lp)
            _acc.append(int(acc) + 1)
            return best, acc, p

        def topk_rec(*a, _orig=orig_topk, _trees=trees, **kw):
            res = _orig(*a, **kw)
            _trees.append(res[0][0].tolist())
            return res

        ea_model.evaluate_posterior = eval_rec
        model.ea_layer.topK_genrate = topk_rec
        try:
            for prompt in greedy["prompts"]:
                accepts.clear()
                trees.clear()
                ids = model.eagenerate(torch.tensor([prompt]), temperature=0.0,
                                       max_new_tokens=case["max_new_tokens"])
                runs.append({"shape": [t, dpt, k], "prompt": prompt,
                             "tokens": ids[0, len(prompt):].tolist(),
                             "accept_lengths": list(accepts), "trees": [list(x) for x in trees]})
        finally:
            ea_model.evaluate_posterior = orig_eval
    return runs


def stage_reference(work: Path, eagle_repo: Path, eagle_commit: str | None = None) -> None:
    import warnings

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    manifest = json.loads((work / "manifest.json").read_text())
    mods = _import_reference(eagle_repo)
    out = {"meta": {"eagle_repo": str(eagle_repo), "eagle_commit": _ref_commit(eagle_repo, eagle_commit),
                    "transformers": transformers.__version__, "torch": torch.__version__},
           "trees": {}, "greedy": None}
    for case in manifest["trees"]:
        out["trees"][case["spec"]["name"]] = _ref_tree_case(case, mods)
    t1 = time.perf_counter()
    greedy = manifest["greedy"]
    _save_hf_target(greedy)
    out["greedy"] = _ref_greedy(greedy, mods)
    out["hf_greedy"] = _ref_hf_greedy(greedy, greedy["case"]["max_new_tokens"] + 12)
    out["meta"]["seconds"] = {"trees": round(t1 - t0, 2), "greedy": round(time.perf_counter() - t1, 2)}
    _write_json(work / "reference.json", out)
    print(f"reference: {len(out['trees'])} tree cases, {len(out['greedy'])} greedy runs "
          f"({out['meta']['seconds']})")


# ---------------------------------------------------------------------------------------------
# Stage: aerie (aerie's venv)


def aerie_tree_head(spec: dict, state: dict[str, torch.Tensor], lm_head_weight: torch.Tensor | None):
    """aerie's head for a tree case, configured from the same config.json dict as the reference."""
    from services.model.eagle_head import build_head
    from services.model.head_checkpoint import head_config_from_dict

    cfg = head_config_from_dict(head_config_dict(spec), state)
    lm_head = None
    if lm_head_weight is not None:
        lm_head = torch.nn.Linear(spec["hidden"], spec["vocab"], bias=False)
        lm_head.weight.data.copy_(lm_head_weight)
        lm_head.requires_grad_(False)
    head = build_head(cfg, lm_head)
    head.load_state_dict(state, strict=True)
    return head.float().eval().requires_grad_(False)


def aerie_trees(spec: dict, state, lm_head_weight, rounds: list[dict], sort_paths: bool) -> list[dict]:
    """Run aerie's tree builder over the case's rounds; one dict per round (plus the cut margin)."""
    from services.spec.tree import TreeParams, expand, extend, rerank

    head = aerie_tree_head(spec, state, lm_head_weight)
    params = TreeParams(spec["top_k"], spec["depth"], spec["total_tokens"])
    cache = head.new_cache(sum(len(r["tokens"]) for r in rounds) + params.draft_rows)
    out = []
    with torch.no_grad():
        for rd in rounds:
            last = extend(head, cache, rd["features"], rd["tokens"])
            cand = expand(head, cache, last, params)
            tree = rerank(cand, int(rd["tokens"][-1]), params, sort_paths)
            s = torch.sort(cand.scores, descending=True).values
            m = params.size - 1
            margin = float(s[m - 1] - s[m]) if m < s.numel() else float("inf")
            out.append({"tokens": tree.tokens.tolist(), "retrieve_indices": tree.paths.tolist(),
                        "mask": mask_rows(tree.mask), "depths": tree.depths.tolist(), "cut_margin": margin})
    return out


def _aerie_greedy(greedy: dict) -> list[dict]:
    from services.engine.drafter import Drafter
    from services.engine.engine import Engine, GenerationRequest
    from services.engine.verifier import Verifier
    from services.model.head_checkpoint import load_head
    from services.model.loading import load_target
    from services.spec.tree import TreeParams

    case = greedy["case"]
    target = load_target(greedy["target_dir"], torch.float32).model
    head = load_head(greedy["head_dir"], target)
    runs = []
    for (t, d, k) in case["shapes"]:
        for prompt in greedy["prompts"]:
            drafter = Drafter(head, TreeParams(k, d, t))
            trees: list[list[int]] = []
            orig = drafter.draft

            def draft_rec(*a, _orig=orig, _trees=trees, **kw):
                tree = _orig(*a, **kw)
                _trees.append(tree.tokens.tolist())
                return tree

            drafter.draft = draft_rec
            engine = Engine(Verifier(target, head.feature_kind), drafter, target.config.max_context,
                            target.config.vocab_size, ())
            req = GenerationRequest(tuple(prompt), max_new_tokens=case["max_new_tokens"], ignore_eos=True)
            tokens, accepts = [], []
            for step in engine.generate(req):
                tokens += step.tokens
                if step.stats.round_index > 0:
                    accepts.append(step.stats.accept_length)
            runs.append({"shape": [t, d, k], "prompt": prompt, "tokens": tokens, "accept_lengths": accepts,
                         "trees": trees})
    return runs


def _aerie_cli(greedy: dict) -> list[dict]:
    case = greedy["case"]
    exe = Path(sys.executable).with_name("aerie")
    runs = []
    for (t, d, k) in case["shapes"]:
        for prompt in greedy["prompts"]:
            cmd = [str(exe) if exe.is_file() else sys.executable, *([] if exe.is_file() else ["-m", "aerie_cli"]),
                   "generate", "--target", greedy["target_dir"], "--draft", greedy["head_dir"],
                   "--prompt-ids", ",".join(map(str, prompt)), "--dtype", "fp32", "--ignore-eos", "--json",
                   "--max-new-tokens", str(case["max_new_tokens"]), "--tree-tokens", str(t),
                   "--tree-depth", str(d), "--tree-top-k", str(k)]
            # one thread: tiny models, and several threads on a busy machine are far slower
            env = {**os.environ, "AERIE_TORCH_THREADS": os.environ.get("AERIE_TORCH_THREADS", "1")}
            res = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                                 cwd=Path(__file__).resolve().parents[1])
            if res.returncode != 0:
                raise SystemExit(f"aerie generate failed ({res.returncode}): {res.stderr}")
            o = json.loads(res.stdout.strip().splitlines()[-1])
            runs.append({"shape": [t, d, k], "prompt": prompt, "tokens": o["tokens"],
                         "accept_lengths": o["accept_lengths"], "command": " ".join(cmd)})
    return runs


def stage_aerie(work: Path, cli: bool = True) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    manifest = json.loads((work / "manifest.json").read_text())
    out = {"trees": {}, "greedy": None, "cli": None}
    for case in manifest["trees"]:
        spec, d = case["spec"], Path(case["dir"])
        state = _load_tensors(d / "head.safetensors")
        inputs = _load_tensors(d / "inputs.safetensors")
        rounds = [{"features": inputs[f"round{r}.features"], "tokens": inputs[f"round{r}.tokens"]}
                  for r in range(len(spec["rounds"]))]
        lm = inputs.get("lm_head.weight")
        assert tree_case_digest(spec) == case["digest"]
        out["trees"][spec["name"]] = {"greedy": aerie_trees(spec, state, lm, rounds, False),
                                      "sampling": aerie_trees(spec, state, lm, rounds, True)}
    t1 = time.perf_counter()
    out["greedy"] = _aerie_greedy(manifest["greedy"])
    t2 = time.perf_counter()
    if cli:
        out["cli"] = _aerie_cli(manifest["greedy"])
    out["seconds"] = {"trees": round(t1 - t0, 2), "greedy": round(t2 - t1, 2),
                      "cli": round(time.perf_counter() - t2, 2)}
    _write_json(work / "aerie.json", out)
    print(f"aerie: {len(out['trees'])} tree cases, {len(out['greedy'])} greedy runs ({out['seconds']})")


# ---------------------------------------------------------------------------------------------
# Stage: compare


def stage_compare(work: Path) -> bool:
    ref = json.loads((work / "reference.json").read_text())
    ours = json.loads((work / "aerie.json").read_text())
    ok = True
    print(f"reference: {ref['meta']}")
    print("== tree builder (topK_genrate vs grow_tree) ==")
    for name, modes in ref["trees"].items():
        for mode, rounds in modes.items():
            mine = ours["trees"][name][mode]
            bad = []
            for r, (a, b) in enumerate(zip(rounds, mine)):
                for key in ("tokens", "retrieve_indices", "mask", "depths"):
                    if a[key] != b[key]:
                        bad.append(f"round {r} {key}")
            margin = min(x["cut_margin"] for x in mine)
            status = "OK " if not bad and len(rounds) == len(mine) else "MISMATCH"
            ok &= status == "OK "
            print(f"  {status} {name:22s} {mode:8s} rounds={len(rounds)} nodes={len(rounds[0]['tokens'])} "
                  f"paths={[len(x['retrieve_indices']) for x in rounds]} min-cut-margin={margin:.2e}"
                  + (f"  {bad}" if bad else ""))
    print("== greedy generation (eagenerate vs Engine) ==")
    for i, (a, b) in enumerate(zip(ref["greedy"], ours["greedy"])):
        n = len(b["accept_lengths"])
        acc_ok = a["accept_lengths"][:n] == b["accept_lengths"]
        m = min(len(a["tokens"]), len(b["tokens"]))
        tok_ok = a["tokens"][:m] == b["tokens"][:m] and m >= len(b["tokens"]) - 1
        tree_ok = a["trees"][:len(b["trees"])] == b["trees"]
        hf = ref["hf_greedy"][i % len(ref["hf_greedy"])]
        hf_ok = hf[:m] == b["tokens"][:m]
        cli = (ours.get("cli") or [None] * len(ours["greedy"]))[i]
        cli_ok = cli is None or (cli["accept_lengths"] == b["accept_lengths"] and cli["tokens"] == b["tokens"])
        good = acc_ok and tok_ok and tree_ok and hf_ok and cli_ok
        ok &= good
        print(f"  {'OK ' if good else 'MISMATCH'} shape={b['shape']} prompt={b['prompt']}"
              f" rounds aerie/ref={n}/{len(a['accept_lengths'])} tokens-compared={m}"
              f" accept_lengths={b['accept_lengths']}"
              + ("" if acc_ok else f"\n      ref accept_lengths={a['accept_lengths']}")
              + ("" if tok_ok else f"\n      tokens differ: aerie={b['tokens']}\n                     ref={a['tokens']}")
              + ("" if tree_ok else "  [per-round trees differ]")
              + ("" if hf_ok else "  [HF greedy differs]")
              + ("" if cli_ok else f"  [CLI differs: {cli['accept_lengths']}]"))
    multi = sum(x > 1 for r in ours["greedy"] for x in r["accept_lengths"])
    total = sum(len(r["accept_lengths"]) for r in ours["greedy"])
    print(f"  rounds accepting >1 token: {multi}/{total}; CLI runs: "
          f"{'compared' if ours.get('cli') else 'skipped'}")
    print("ALL MATCH" if ok else "MISMATCHES FOUND")
    return ok


# ---------------------------------------------------------------------------------------------
# Stage: golden


def stage_golden(work: Path, path: Path) -> None:
    ref = json.loads((work / "reference.json").read_text())
    manifest = json.loads((work / "manifest.json").read_text())
    trees = []
    for case in manifest["trees"]:
        name = case["spec"]["name"]
        r = ref["trees"][name]
        trees.append({"spec": case["spec"], "digest": case["digest"], "greedy": r["greedy"],
                      # the sampling path order is the only difference: keep only retrieve_indices
                      "sampling_retrieve_indices": [x["retrieve_indices"] for x in r["sampling"]]})
        for a, b in zip(r["greedy"], r["sampling"]):
            assert (a["tokens"], a["mask"], a["depths"]) == (b["tokens"], b["mask"], b["depths"])
    g = manifest["greedy"]
    runs = [{"shape": x["shape"], "prompt": x["prompt"], "accept_lengths": x["accept_lengths"],
             "tokens": x["tokens"]} for x in ref["greedy"]]
    meta = dict(ref["meta"])
    meta.pop("seconds", None)
    meta.pop("eagle_repo", None)
    golden = {
        "about": "Outputs of the official EAGLE reference (SafeAILab/EAGLE) on weights and inputs that "
                 "scripts/reference_golden.py generates from the seeds below; regenerate with "
                 "`scripts/reference_golden.py all --write-golden` (see its docstring).",
        "reference": meta,
        "trees": trees,
        "greedy": {"case": g["case"], "digest": g["digest"], "prompts": g["prompts"], "runs": runs},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(golden, separators=(",", ":"))
    # one line per record keeps diffs readable and the file small
    text = text.replace(',{"spec"', ',\n{"spec"').replace(',"greedy":{"case"', ',\n"greedy":{"case"')
    path.write_text(text + "\n")
    print(f"golden: wrote {path} ({path.stat().st_size / 1024:.1f} KiB)")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["inputs", "reference", "aerie", "compare", "golden", "all"])
    p.add_argument("--work", type=Path, default=Path("/tmp/aerie_refcheck"), help="work directory")
    p.add_argument("--eagle-repo", type=Path, help="SafeAILab/EAGLE checkout @ cb7e084 (reference, all)")
    p.add_argument("--eagle-commit", default=None,
                   help="commit to record when --eagle-repo is an extracted copy, not a git checkout")
    p.add_argument("--ref-python", default=None,
                   help="python of a venv with transformers 4.53.x for the reference stage (all)")
    p.add_argument("--no-cli", action="store_true", help="skip the `aerie generate` runs")
    p.add_argument("--write-golden", action="store_true", help="all: also write the golden JSON")
    p.add_argument("--golden", type=Path, default=GOLDEN_PATH)
    a = p.parse_args(argv)
    if a.stage in ("reference", "all") and a.eagle_repo is None:
        p.error("--eagle-repo is required for this stage")
    if a.stage == "inputs":
        stage_inputs(a.work)
    elif a.stage == "reference":
        stage_reference(a.work, a.eagle_repo.resolve(), a.eagle_commit)
    elif a.stage == "aerie":
        stage_aerie(a.work, cli=not a.no_cli)
    elif a.stage == "compare":
        return 0 if stage_compare(a.work) else 1
    elif a.stage == "golden":
        stage_golden(a.work, a.golden)
    else:
        if not a.ref_python:
            p.error("all needs --ref-python (a venv with transformers 4.53.x)")
        t0 = time.perf_counter()
        stage_inputs(a.work)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([a.ref_python, __file__, "reference", "--work", str(a.work),
                        "--eagle-repo", str(a.eagle_repo.resolve()),
                        *(["--eagle-commit", a.eagle_commit] if a.eagle_commit else [])], check=True, env=env)
        stage_aerie(a.work, cli=not a.no_cli)
        ok = stage_compare(a.work)
        if a.write_golden:
            if not ok:
                print("not writing the golden: aerie and the reference differ")
                return 1
            stage_golden(a.work, a.golden)
        print(f"total {time.perf_counter() - t0:.1f} s")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
