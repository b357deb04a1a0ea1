"""Generate the Python stubs of proto/aerie/v1/*.proto with grpcio-tools. The output in
services/rpc/gen/ is never edited by hand; tests/rpc/test_stubs_fresh.py regenerates it into a
temporary directory and compares bytes.

    python -m services.rpc.protogen           # rewrite services/rpc/gen/
    python -m services.rpc.protogen --check   # exit 1 when the checked-in stubs are stale

The stubs import each other as `aerie.v1.*` (protoc has no relative-import mode), so
`services.rpc.stubs` puts gen/ on sys.path; import them from there, never from gen/ directly.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
GEN_DIR = Path(__file__).with_name("gen")


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "aerie" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    """Write the stubs (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) of every proto file under `out`."""
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    argv = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, proto_files())]
    if protoc.main(argv) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR}")


def generated_files(root: Path) -> dict[str, bytes]:
    """relative path -> bytes of every generated file under `root`."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts}


def stale_files() -> list[str]:
    """Files whose checked-in bytes differ from a fresh generation (missing or extra included)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp))
    current = generated_files(GEN_DIR)
    return sorted(k for k in fresh.keys() | current.keys() if fresh.get(k) != current.get(k))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report stale stubs")
    args = p.parse_args()
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: services/rpc/gen/{name}", file=sys.stderr)
        return 1 if stale else 0
    shutil.rmtree(GEN_DIR, ignore_errors=True)
    generate(GEN_DIR)
    print(f"wrote {len(generated_files(GEN_DIR))} files under {GEN_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
