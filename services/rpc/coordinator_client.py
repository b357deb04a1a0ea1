"""A client of the Coordinator API shaped like the in-process engine, so `aerie generate` prints the
same output either way:

    session = connect("127.0.0.1:50051", target=None)
    for step in session.engine.generate(GenerationRequest(...)):   # StepOutput per committed round
        ...

The tokenizer is the served target's (GetInfo names it; `connect` refuses a --target that names
another model), loaded locally without the weights (services/text.py): the services hold the
models, the client only encodes the prompt and decodes the text. `draft_path` and `tree` are filled from the first message,
which says where the sequence runs. Call failures raise `RemoteError` with the server's message and
status code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from services.engine.engine import GenerationRequest, StepOutput
from services.errors import AerieError, InvalidRequest
from services.rpc import codec
from services.rpc.channel import open_channel
from services.rpc.security import Security
from services.rpc.config import DEFAULT_MAX_MESSAGE_BYTES
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from services.spec.tree import TreeParams


class RemoteError(AerieError):
    """A Coordinator call failed; `code` is its gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RemoteEngine:
    def __init__(self, session: RemoteSession) -> None:
        self._session = session

    def generate(self, req: GenerationRequest, seq_id: str | None = None) -> Iterator[StepOutput]:
        s = self._session
        call = s.stub.Generate(codec.encode_generation_request(req, seq_id or ""), timeout=s.timeout_s)
        try:
            for msg in call:
                if msg.HasField("info"):
                    s.sequence_id = msg.sequence_id
                    s.placement = (msg.info.placement.drafter, msg.info.placement.verifier)
                    s.draft_path = msg.info.draft or None
                    s.tree = codec.decode_tree_params(msg.info.tree) if msg.info.HasField("tree") else None
                yield StepOutput(list(msg.tokens), codec.decode_stats(msg.stats), msg.finish_reason or None)
        except grpc.RpcError as e:
            raise RemoteError(e.code(), e.details() or str(e)) from None
        finally:
            call.cancel()  # no-op after a normal end; tells the coordinator when the reader stops early


class RemoteSession:
    """What `aerie generate` needs from an engine: `.engine.generate`, `.tokenizer`, paths, tree."""

    def __init__(self, address: str, tokenizer: Any | None, target_path: str, timeout_s: float | None,
                 security: Security | None = None) -> None:
        """`security`: TLS and the API token; default from AERIE_TLS_CA (+ AERIE_TLS_CERT/KEY) and
        AERIE_API_TOKEN (services/rpc/security.py)."""
        self.address = address
        self.channel = open_channel(address, DEFAULT_MAX_MESSAGE_BYTES,
                                    security if security is not None else Security.client_from_env())
        self.stub = coordinator_grpc.CoordinatorStub(self.channel)
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        self.target_path = target_path
        self.dtype: str | None = None  # as the verifiers report it (GetInfo)
        self.draft_path: str | None = None
        self.tree: TreeParams | None = None
        self.sequence_id: str | None = None
        self.placement: tuple[str, str] | None = None
        self.engine = RemoteEngine(self)

    def get_info(self) -> cpb.CoordinatorInfo:
        try:
            return self.stub.GetInfo(pb.InfoRequest(), timeout=30)
        except grpc.RpcError as e:
            raise RemoteError(e.code(), e.details() or str(e)) from None

    def get_sequence(self, seq_id: str) -> cpb.Sequence:
        try:
            return self.stub.GetSequence(cpb.GetSequenceRequest(sequence_id=seq_id), timeout=30)
        except grpc.RpcError as e:
            raise RemoteError(e.code(), e.details() or str(e)) from None

    def cancel(self, seq_id: str) -> cpb.CancelResponse:
        try:
            return self.stub.Cancel(cpb.CancelRequest(sequence_id=seq_id), timeout=30)
        except grpc.RpcError as e:
            raise RemoteError(e.code(), e.details() or str(e)) from None

    def close(self) -> None:
        self.channel.close()


def same_model(a: str, b: str) -> bool:
    """Whether two target names (paths on possibly different machines) name the same model: the same
    resolved path, else the same file or directory name."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve() or pa.name == pb.name
    return pa.name == pb.name


def served_tokenizer_source(target: str | None, served: str, address: str) -> str | None:
    """Where to load the served target's tokenizer from on this machine (None: nowhere). Raises
    InvalidRequest when --target names another model than the one the pipeline serves."""
    from services.model.loading import find_default_gguf

    if target is not None:
        if not same_model(target, served):
            raise InvalidRequest(f"--target {target} is not the target the pipeline at {address} serves "
                                 f"({served}, from its GetInfo): leave --target out or name that model")
        return target
    if Path(served).expanduser().exists():  # `aerie up`, or a cluster sharing the file system
        return served
    try:
        default = find_default_gguf()
    except AerieError:
        return None
    return default if same_model(default, served) else None


def connect(address: str, target: str | None, timeout_s: float | None = None) -> RemoteSession:
    """A session whose tokenizer is the served target's (checked with the coordinator's GetInfo), or
    None when this machine has no copy of it (then only --prompt-ids work)."""
    from services.text import load_tokenizer

    session = RemoteSession(address, None, "", timeout_s)
    try:
        served = session.get_info()
        session.target_path = served.target
        session.dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(served.dtype, served.dtype)
        source = served_tokenizer_source(target, served.target, address)
        session.tokenizer = load_tokenizer(source) if source is not None else None
    except BaseException:
        session.close()
        raise
    return session
