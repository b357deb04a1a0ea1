"""Build a local engine from model paths: the one place the CLI and the benchmark assemble
target + head + drafter + verifier. Does not parse arguments or format prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.device import check_dtype, default_draft_dtype, is_gpu
from services.engine.calibration import head_costs, load_report, target_costs
from services.engine.drafter import Drafter
from services.engine.engine import Engine
from services.engine.roles import FeatureKind
from services.engine.verifier import Verifier
from services.errors import CheckpointError
from services.model.eagle_head import DraftHead
from services.model.head_checkpoint import load_head
from services.model.loading import LoadedTarget, find_default_gguf, load_head_anchors, load_target
from services.model.runner import warm_up_at_start
from services.spec.budget import AUTO_LARGEST, build_budget
from services.spec.cost import CostCurve, CostModel
from services.spec.tree import TreeParams

# Target dtypes. int8 = fp32 weights quantized to int8 linears after loading (opt-in, never the default;
# NOT lossless on the default model: docs/design.md "Cheaper rounds").
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}
DRAFT_DTYPES = ("fp32", "bf16", "int8")  # the default: services.device.default_draft_dtype
PLAIN_RUN_ENV = "AERIE_PLAIN_RUN"  # plain rounds per run on a GPU (0 = one step a round), as the coordinator's
LOCAL_PLAIN_RUN = 16
# 0: every EAGLE round reads its tree and verdict back on the host (Engine device_trees / verdict_drafts
# off, and a verifier that drafts too runs no device rounds: verifier_svc/device_round.py); default on
# where the round can stay on the device (a GPU): docs/gpu.md
DEVICE_ROUND_ENV = "AERIE_DEVICE_ROUND"
# The trained head for the default model, shipped in the repository (issue: default model).
DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-eagle"


def device_round() -> bool | None:
    """Engine's device_trees from AERIE_DEVICE_ROUND: "0" -> False (off), else None (wherever possible)."""
    value = os.environ.get(DEVICE_ROUND_ENV, "1").strip()
    if value not in ("0", "1"):
        raise CheckpointError(f"{DEVICE_ROUND_ENV} must be 0 or 1; got {value!r}")
    return False if value == "0" else None


@dataclass(frozen=True, slots=True)
class LocalEngine:
    engine: Engine
    tokenizer: Any | None
    target_path: str  # as given (a directory or a .gguf file)
    draft_path: str | None
    model_dir: str  # the Hugging Face directory actually loaded (the converted cache for GGUF)


SPEC_MODES = ("eagle", "sam", "eagle+sam")


@dataclass(frozen=True, slots=True)
class DraftSpec:
    """What `--draft` asks for (case-insensitive keywords):

        --draft       head     retrieval
        (not given)   "auto"   no
        auto, eagle   "auto"   no        "auto": the shipped head for the default model, if present
        none          None     no        plain decoding
        sam           None     yes       retrieval only (the suffix index)
        eagle+sam     "auto"   yes
        DIR           DIR      no        a head directory
        DIR+sam       DIR      yes
    """

    head: str | None  # "auto", a head directory, or None (no head)
    retrieval: bool = False

    @staticmethod
    def parse(draft: str | None) -> DraftSpec:
        if draft is None:
            return DraftSpec("auto")
        retrieval = draft.lower() == "sam" or draft.lower().endswith("+sam")
        head = draft[: -len("+sam")] if draft.lower().endswith("+sam") else draft
        if head.lower() in ("sam", "none"):
            return DraftSpec(None, retrieval)
        return DraftSpec("auto" if head.lower() in ("auto", "eagle") else head, retrieval)

    def head_path(self, target: str | None) -> str | None:
        """The head directory to load: "auto" is the shipped head, for the default model only."""
        if self.head == "auto":
            return str(DEFAULT_HEAD) if target is None and (DEFAULT_HEAD / "config.json").is_file() else None
        return self.head


def resolve_draft(draft: str | None, target: str | None) -> str | None:
    """The head directory `--draft` (and `--target`) ask for, or None (no head)."""
    return DraftSpec.parse(draft).head_path(target)


def checkpoint_shape_id(path: str | Path) -> str:
    """What a head's cost depends on, as a short hash: its config.json and the name and size of each
    weight file. A head replaced in place by one of another shape (EAGLE-2 by EAGLE-3, another dtype)
    gets its own calibration; new weights of the same shape, or a new report.json, keep the cached one."""
    import hashlib

    h = hashlib.sha1()
    root = Path(path)
    for f in sorted(root.iterdir()) if root.is_dir() else [root]:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.is_file() and f.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:12]


def build_local_engine(target: str | None, draft: str | None, dtype: str = "fp32",
                       tree: TreeParams | None = None, draft_vocab: int | None = None,
                       draft_dtype: str | None = None, *, recalibrate: bool = False,
                       device: str = "cpu", warm_up: bool = True) -> LocalEngine:
    """`draft`: a head directory, `none`, `auto`, `sam`, `eagle+sam` (see DraftSpec). `tree` None =
    the auto budget (cost model calibrated on this device, cached); a TreeParams = that fixed shape.
    draft_vocab: None = the head's default (load_head), 0 = full, K = the K most frequent tokens;
    draft_dtype: fp32 | bf16 | int8, None = services.device.default_draft_dtype (int8 on the CPU, bf16 on a GPU).
    device: "cpu", "cuda" or "cuda:N" (validated by services.device); every model lives there.
    warm_up: capture the verifier's and the drafter's CUDA graphs before returning (CUDA only;
    False for a caller that uses neither, e.g. the drafter service, which warms its own drafter)."""
    _check_dtypes(dtype, draft_dtype, device)
    gpu = is_gpu(device)
    target_path = target or find_default_gguf()
    loaded = load_target(target_path, DTYPES[dtype], device)
    model = loaded.model
    spec = DraftSpec.parse(draft)
    draft_path = spec.head_path(target)
    retrieval = spec.retrieval
    drafter = None
    head = None
    feature_kind: FeatureKind = "none"
    if draft_path:
        draft_dtype = draft_dtype or default_draft_dtype(device)
        head = load_head(draft_path, model, draft_vocab=draft_vocab, draft_dtype=draft_dtype)
        drafter = Drafter(head, tree or AUTO_LARGEST)
        feature_kind = head.feature_kind
    if dtype == "int8":  # after the head took what it needs from the fp32 lm_head
        from services.model.quant import quantize_linears
        quantize_linears(model)
    budget = None
    if drafter is not None or retrieval:  # measured after quantization: the costs of what runs
        model_id = f"{loaded.path}|{dtype}"
        costs = CostModel(target_costs(model, model_id, recalibrate))
        if head is not None:
            assert draft_path is not None  # the head was loaded from it
            costs = CostModel(costs.verify, *head_costs(head, _head_id(model_id, draft_path, draft_vocab, draft_dtype),
                                                        recalibrate))
        budget = build_budget(costs, load_report(draft_path), tree, drafter is not None, retrieval)
    verifier = Verifier(model, feature_kind)
    if warm_up:  # CUDA: graphs before the first request
        warm_up_at_start(verifier.runner, verifier.max_sequences)
        if drafter is not None:
            warm_up_at_start(drafter, drafter.max_sequences)
    eos = model.config.eos_token_ids
    tok = loaded.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        eos = tuple(sorted(set(eos) | {int(tok.eos_token_id)}))
    # on a GPU, plain rounds run in runs whose next step is queued before the previous token is read
    # (services/engine/plain_run.py); on the CPU a queued step is computed at once, so nothing overlaps
    plain_run = int(os.environ.get(PLAIN_RUN_ENV, LOCAL_PLAIN_RUN)) if gpu else 0
    engine = Engine(verifier, drafter, model.config.max_context, model.config.vocab_size, eos, budget, retrieval,
                    plain_run=plain_run, device_trees=device_round())
    return LocalEngine(engine, tok, target_path, draft_path, loaded.path)


@dataclass(frozen=True, slots=True)
class LocalHead:
    """A draft head loaded for a drafter service: what it needs of the target and nothing more."""
    head: DraftHead
    costs: tuple[CostCurve, CostCurve]  # its measured cost curves (layer, logits) for the coordinator's budget
    draft_path: str
    max_context: int  # the target's


def build_local_head(target: str | None, draft: str | None, dtype: str = "fp32", draft_vocab: int | None = None,
                     draft_dtype: str | None = None, *, recalibrate: bool = False, device: str = "cpu",
                     loaded: LoadedTarget | None = None) -> LocalHead:
    """The head of `draft` for `target`, as build_local_engine loads it (the same arguments, numerics
    and cost calibration), over only the target's embedding and lm_head (load_head_anchors): the
    drafter service never runs the target, and on a GPU beside a verifier it held a second copy of
    it before (the whole Llama-3.1-8B: 16 GB; now the two 1 GB tensors). `loaded`: the target this
    process already holds (a verifier that drafts too): the head uses its embedding and lm_head, as
    the in-process engine's head does, and nothing is read again."""
    _check_dtypes(dtype, draft_dtype, device)
    spec = DraftSpec.parse(draft)
    draft_path = spec.head_path(target)
    if draft_path is None:
        raise CheckpointError("a drafter needs an EAGLE head: pass --draft DIR")
    anchors = loaded or load_head_anchors(target or find_default_gguf(), DTYPES[dtype], device)
    draft_dtype = draft_dtype or default_draft_dtype(device)
    head = load_head(draft_path, anchors.model, draft_vocab=draft_vocab, draft_dtype=draft_dtype)
    model_id = f"{anchors.path}|{dtype}"
    costs = head_costs(head, _head_id(model_id, draft_path, draft_vocab, draft_dtype), recalibrate)
    return LocalHead(head, costs, draft_path, anchors.model.config.max_context)


def _head_id(model_id: str, draft_path: str, draft_vocab: int | None, draft_dtype: str | None) -> str:
    """The head's cost-calibration key: its target and dtype, its checkpoint's shape, its vocabulary."""
    return f"{model_id}|{draft_path}|{checkpoint_shape_id(draft_path)}|vocab={draft_vocab}|{draft_dtype}"


def _check_dtypes(dtype: str, draft_dtype: str | None, device: str) -> None:
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    if draft_dtype is not None and draft_dtype not in DRAFT_DTYPES:
        raise CheckpointError(f"draft dtype must be one of {list(DRAFT_DTYPES)}; got {draft_dtype!r}")
    check_dtype(dtype, device)
    if is_gpu(device) and "int8" in (dtype, draft_dtype):
        raise CheckpointError("int8 linears are CPU-only (torch's dynamic int8 kernels): use --dtype/--draft-dtype "
                              "bf16 or fp32 with --device cuda")
