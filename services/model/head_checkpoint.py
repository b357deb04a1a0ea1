"""Load and save EAGLE heads in the published formats (eagle.md 1.1-1.3).

A head directory holds `config.json` (a Llama config with `num_hidden_layers: 1`; EAGLE-3 adds
`draft_vocab_size`, optionally `target_hidden_size`) and `pytorch_model.bin` or `model.safetensors`.
The kind is read from the weights: EAGLE-3 has `midlayer.hidden_norm.weight` (also accepted under the
serving frameworks' `layers.0.` prefix). `fc.bias` is expected only when the config's `bias` is true
(default true, as the reference). `embed_tokens.weight` may be absent: it is then copied from the
target, as the reference's `load_emb` does. Everything is checked against the target before use.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.errors import CheckpointError, IncompatibleHead, InvalidRequest
from services.model.draft_vocab import COUNTS_FILE, load_counts, save_counts
from services.model.eagle_head import DraftHead, HeadConfig, build_head
from services.model.head_kind import HeadKind
from services.model.loading import read_weights
from services.model.target import TargetModel

WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")


def head_config_from_dict(d: dict, state: dict[str, torch.Tensor]) -> HeadConfig:
    kind: HeadKind = "eagle3" if any(k.endswith("hidden_norm.weight") for k in state) else "eagle"
    try:
        rope_scaling = d.get("rope_scaling")
        if rope_scaling:
            kind_s = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind_s != "linear":
                raise CheckpointError(
                    f"draft-head rope_scaling type {kind_s!r} is not supported (only 'linear', as the reference)")
            rope_scaling = {"rope_type": "linear", "factor": float(rope_scaling["factor"])}
        return HeadConfig(
            kind=kind,
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_heads=int(d["num_attention_heads"]),
            num_kv_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            vocab_size=int(d["vocab_size"]),
            rope_theta=float(d.get("rope_theta", 10000.0)),  # the draft's own, else 10000
            rope_scaling=rope_scaling,
            fc_bias=bool(d.get("bias", True)) if kind == "eagle" else False,
            qkv_bias=bool(d.get("qkv_bias", False)),
            draft_vocab_size=int(d["draft_vocab_size"]) if d.get("draft_vocab_size") else None,
            target_hidden_size=int(d["target_hidden_size"]) if d.get("target_hidden_size") else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        )
    except KeyError as e:
        raise CheckpointError(f"draft-head config.json is missing the field {e.args[0]!r}") from None


def check_compatible(cfg: HeadConfig, target: TargetModel) -> None:
    t = target.config
    if cfg.vocab_size != t.vocab_size:
        raise IncompatibleHead(
            f"draft head vocab_size {cfg.vocab_size} does not match the target's {t.vocab_size}")
    if cfg.kind == "eagle":
        if cfg.hidden_size != t.hidden_size:
            raise IncompatibleHead(
                f"EAGLE head hidden_size {cfg.hidden_size} does not match the target's {t.hidden_size}")
    else:
        if cfg.feature_size != 3 * t.hidden_size:
            raise IncompatibleHead(
                f"EAGLE-3 head fuses 3 x {cfg.feature_size // 3} features but the target's hidden size "
                f"is {t.hidden_size}")
        if t.num_layers < 7:
            raise IncompatibleHead(
                f"EAGLE-3 needs a target with at least 7 layers for three distinct feature taps; "
                f"this one has {t.num_layers}")


# Draft vocabulary when the head directory has token counts and none is asked for (docs/design.md
# "Cheaper rounds": draft cost and acceptance at 4k/8k/16k/full on the dev prompts).
DEFAULT_DRAFT_VOCAB = 8192


def load_head(path: str | Path, target: TargetModel, dtype: torch.dtype | None = None,
              draft_vocab: int | None = None, draft_dtype: str | None = None) -> DraftHead:
    """Load a head directory for `target` (device and dtype follow the target unless given).

    draft_vocab: K most frequent tokens to draft from (the directory's `token_counts.safetensors`);
    None = DEFAULT_DRAFT_VOCAB when the directory has counts, else the full vocabulary; 0 = full.
    draft_dtype: "fp32" | "bf16" | "int8" (eagle_head.set_draft_dtype); None = as `dtype`."""
    from services.model.hub import resolve_model

    root = Path(resolve_model(str(path), "draft head"))  # a Hub id -> its cached snapshot
    if not root.is_dir():
        raise CheckpointError(f"draft-head path {root} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"draft-head directory {root} has no config.json")
    try:
        cfg_dict = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"draft-head config {cfg_path} is not valid JSON: {e}") from None
    weights = next((root / f for f in WEIGHT_FILES if (root / f).is_file()), None)
    if weights is None:
        raise CheckpointError(f"draft-head directory {root} has neither {' nor '.join(WEIGHT_FILES)}")
    state = read_weights(weights)
    cfg = head_config_from_dict(cfg_dict, state)
    check_compatible(cfg, target)
    head = build_head(cfg, target.lm_head)
    state = _normalise_keys(state, cfg)
    if "embed_tokens.weight" not in state:
        if cfg.hidden_size != target.config.hidden_size:
            raise CheckpointError(f"{weights} has no embed_tokens.weight and the target's embedding "
                                  f"width differs ({target.config.hidden_size} vs {cfg.hidden_size})")
        state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().float()
    _load_exact(head, state, weights)
    head = head.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)
    head.token_counts = load_counts(root, cfg.vocab_size)
    k = draft_vocab
    if k is None:
        k = DEFAULT_DRAFT_VOCAB if head.token_counts is not None else 0
    if k < 0:
        raise InvalidRequest(f"draft_vocab must be >= 0 (0 = the full vocabulary); got {k}")
    if k:
        if head.token_counts is None:
            raise CheckpointError(f"draft_vocab={k} needs token counts, but {root} has no {COUNTS_FILE}; "
                                  f"build one with `aerie draft-vocab --from FILES --out {root / COUNTS_FILE}`")
        head.restrict_vocab(head.token_counts, k)
    if draft_dtype is not None:
        head.set_draft_dtype(draft_dtype)
    return head


def _normalise_keys(state: dict[str, torch.Tensor], cfg: HeadConfig) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if cfg.kind == "eagle3" and k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        out[k] = v
    if cfg.kind == "eagle3" and cfg.draft_vocab == cfg.vocab_size:
        out.pop("d2t", None)
        out.pop("t2d", None)
    return out


def _load_exact(head: DraftHead, state: dict[str, torch.Tensor], source: Path) -> None:
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        hint = ""
        if "fc.bias" in missing or "fc.bias" in unexpected:
            hint = " (fc.bias follows the config's `bias` field, default true)"
        raise CheckpointError(f"draft head {source}: {'; '.join(parts)}{hint}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(f"draft head {source}: {k} has shape {list(v.shape)}, "
                                  f"expected {list(expected[k].shape)}")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def head_config_dict(cfg: HeadConfig) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "pad_token_id": 0,
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = {"type": "linear", "factor": cfg.rope_scaling["factor"]}
    if cfg.kind == "eagle":
        d["bias"] = cfg.fc_bias
    if cfg.qkv_bias:
        d["qkv_bias"] = True
    if cfg.kind == "eagle3":
        d["draft_vocab_size"] = cfg.draft_vocab
        if cfg.target_hidden_size:
            d["target_hidden_size"] = cfg.target_hidden_size
    return d


def save_head(head: DraftHead, path: str | Path, fmt: str = "safetensors",
              dtype: torch.dtype | None = None, skip: tuple[str, ...] = ()) -> Path:
    """Write config.json and the weights (`model.safetensors` or `pytorch_model.bin`).
    `skip=("embed_tokens.weight",)` leaves out the frozen embedding copy; loading restores it from
    the target, as the reference's `load_emb` does."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(head_config_dict(head.config), indent=2) + "\n")
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in head.state_dict().items() if k not in skip}
    if head.token_counts is not None:
        save_counts(root, head.token_counts)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(state, str(root / "model.safetensors"))
    elif fmt == "bin":
        torch.save(state, str(root / "pytorch_model.bin"))
    else:
        raise ValueError(f"fmt must be 'safetensors' or 'bin'; got {fmt!r}")
    return root
