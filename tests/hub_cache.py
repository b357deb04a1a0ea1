"""A Hugging Face Hub cache laid out as `huggingface_hub` writes it, for tests that resolve Hub ids
with no network (HF_HUB_CACHE pointing here, HF_HUB_OFFLINE=1):

    <cache>/models--ORG--NAME/blobs/<sha256 of the file>          the bytes
    <cache>/models--ORG--NAME/snapshots/<revision>/<file>          a relative symlink to its blob
    <cache>/models--ORG--NAME/refs/main                            the revision `main` points at
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(cache: Path, repo_id: str, source: Path, revision: str = "0" * 40,
                     ref: str | None = "main") -> Path:
    """Copy every file of the directory `source` into `cache` as snapshot `revision` of `repo_id`
    (and point `ref` at it). Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(revision)
    return snapshot
