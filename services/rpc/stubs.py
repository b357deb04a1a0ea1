"""The generated `aerie.v1` modules (services/rpc/gen/, written by `services.rpc.protogen`).

protoc emits absolute imports (`from aerie.v1 import common_pb2`), so gen/ goes on sys.path once,
here, and every module is imported under that one name (the protobuf descriptor pool rejects a
second import of the same file under another name). Import stubs from this module only.
"""

from __future__ import annotations

import sys
from pathlib import Path

_GEN = str(Path(__file__).with_name("gen"))
if _GEN not in sys.path:
    sys.path.append(_GEN)

from aerie.v1 import common_pb2 as common  # noqa: E402
from aerie.v1 import coordinator_pb2 as coordinator  # noqa: E402
from aerie.v1 import coordinator_pb2_grpc as coordinator_grpc  # noqa: E402
from aerie.v1 import drafter_pb2 as drafter  # noqa: E402
from aerie.v1 import drafter_pb2_grpc as drafter_grpc  # noqa: E402
from aerie.v1 import verifier_pb2 as verifier  # noqa: E402
from aerie.v1 import verifier_pb2_grpc as verifier_grpc  # noqa: E402

__all__ = ["common", "coordinator", "coordinator_grpc", "drafter", "drafter_grpc", "verifier",
           "verifier_grpc"]
