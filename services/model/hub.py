"""Model names -> local paths: a path on disk as it is, a Hugging Face Hub id through `huggingface_hub`.

    resolve_model("/models/llama")                         -> "/models/llama"          (exists: as is)
    resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        -> ".../models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/<rev>"
    resolve_model("org/name@v1.0")                         -> that revision's snapshot
    resolve_model("org/name/model.Q8_0.gguf")              -> the cached file (one GGUF out of a repository)

A Hub id is looked up in the local Hugging Face cache first (no network); only when it is not there,
and neither HF_HUB_OFFLINE nor AERIE_OFFLINE is set, is it downloaded (token: HF_TOKEN). The cache is
AERIE_DOWNLOAD_DIR (`--download-dir`), else HF_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's
default; all are read when called, not at import, so a command sets them for its child processes.

Downloads take only what aerie loads: config and tokenizer files and the weights in one layout
(safetensors when the repository has them, else pytorch .bin). A name that is neither an existing
path nor shaped like a Hub id (ORG/NAME[@REV][/FILE.gguf]) is a ModelUnavailable naming the path.

It does not load anything (loading.py, head_checkpoint.py do), and never reaches the network for a
path that exists or an id already in the cache.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from services.errors import ModelUnavailable

# ORG/NAME, optional @REVISION, optional /FILE.gguf (Hub names: letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+?))?(?:/(?P<file>[\w.-]+\.gguf))?$")
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
BIN_FILES = ["*.json", "*.bin", "tokenizer.model", "*.txt", "*.jinja"]
TRUE = ("1", "on", "yes", "true")


def parse_hub_id(name: str) -> tuple[str, str | None, str | None] | None:
    """(repo_id, revision, gguf file) when `name` is shaped like a Hub id, else None.

    "org/name" -> ("org/name", None, None); "org/name@main/x.gguf" -> ("org/name", "main", "x.gguf");
    "./dir", "/abs/dir", "~/dir", "dir" -> None (a local path)."""
    if name.startswith((".", "/", "~")) or "\\" in name:
        return None
    m = _HUB_ID.match(name)
    if m is None:
        return None
    return m.group("repo"), m.group("rev"), m.group("file")


def cache_dir() -> str | None:
    """Where Hub snapshots live: AERIE_DOWNLOAD_DIR, else HF_HUB_CACHE, else $HF_HOME/hub, else None
    (huggingface_hub's own default, ~/.cache/huggingface/hub)."""
    for var in ("AERIE_DOWNLOAD_DIR", "HF_HUB_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def offline() -> bool:
    """HF_HUB_OFFLINE or AERIE_OFFLINE set to a true value: the cache only, no download."""
    return any(os.environ.get(v, "").strip().lower() in TRUE for v in ("HF_HUB_OFFLINE", "AERIE_OFFLINE"))


def resolve_model(name: str, what: str = "model") -> str:
    """The local path of `name`: itself when it exists, else its Hub snapshot (cache, then download).

    what: "model" or "draft head", for messages and for which files a download takes.
    Raises ModelUnavailable when the path does not exist and the Hub cannot provide it."""
    if Path(name).expanduser().exists():
        return name
    hub = parse_hub_id(name)
    if hub is None:
        raise ModelUnavailable(f"{what} path {Path(name).expanduser()} does not exist (and it is not a Hugging Face "
                               f"Hub id ORG/NAME)")
    repo, revision, gguf = hub
    cached = _from_cache(repo, revision, gguf, what)
    if cached is not None:
        return cached
    where = cache_dir() or "huggingface_hub's default cache"
    if offline():
        raise ModelUnavailable(f"{what} {name} is neither a local path nor in the Hugging Face cache ({where}), and "
                               f"HF_HUB_OFFLINE or AERIE_OFFLINE is set: "
                               f"download it where the network allows (hf download {repo}) or unset it")
    return _download(name, repo, revision, gguf, what)


def cached(name: str) -> str | None:
    """The local path of `name` when it exists or is a Hub id already in the cache, else None; never
    the network (a client that only needs a served model's tokenizer must not download its weights)."""
    if Path(name).expanduser().exists():
        return name
    hub = parse_hub_id(name)
    return None if hub is None else _from_cache(*hub, "model")


def _from_cache(repo: str, revision: str | None, gguf: str | None, what: str) -> str | None:
    """The snapshot (or GGUF file) already in the cache, complete enough to load; None when absent."""
    import huggingface_hub as hf
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        if gguf is not None:
            found = hf.try_to_load_from_cache(repo, gguf, cache_dir=cache_dir(), revision=revision)
            return found if isinstance(found, str) else None
        path = hf.snapshot_download(repo, revision=revision, cache_dir=cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
    return path if (Path(path) / "config.json").is_file() else None


def _download(name: str, repo: str, revision: str | None, gguf: str | None, what: str) -> str:
    import huggingface_hub as hf
    from huggingface_hub import errors

    token = os.environ.get("HF_TOKEN") or None
    print(f"aerie: downloading {what} {name} from the Hugging Face Hub into {cache_dir() or 'the default cache'}",
          file=sys.stderr, flush=True)
    try:
        if gguf is not None:
            return hf.hf_hub_download(repo, gguf, revision=revision, cache_dir=cache_dir(), token=token)
        patterns = MODEL_FILES if what == "model" else sorted(set(MODEL_FILES) | set(BIN_FILES))
        path = hf.snapshot_download(repo, revision=revision, cache_dir=cache_dir(), token=token,
                                    allow_patterns=patterns)
        if what == "model" and not any(Path(path).glob("*.safetensors")):  # an older repository: .bin weights
            path = hf.snapshot_download(repo, revision=revision, cache_dir=cache_dir(), token=token,
                                        allow_patterns=BIN_FILES)
        return path
    except errors.GatedRepoError:
        raise ModelUnavailable(f"{what} {name} is gated on the Hugging Face Hub: accept its license there and set "
                               f"HF_TOKEN") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.EntryNotFoundError) as e:
        raise ModelUnavailable(f"{what} {name} is not on the Hugging Face Hub ({type(e).__name__}; a private "
                               f"repository needs HF_TOKEN)") from None
    except (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError) as e:  # no network, proxy, disk
        raise ModelUnavailable(f"cannot download {what} {name} from the Hugging Face Hub: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None
