"""A client of the Coordinator API shaped like the in-process engine, so `aerie generate` prints the
same output either way:

    session = connect("127.0.0.1:50051", target=None)
    for step in session.engine.generate(GenerationRequest(...)):   # StepOutput per committed round
        ...

The tokenizer comes from --target locally (the services hold the models; the client only needs to
encode the prompt and decode the text). `draft_path` and `tree` are filled from the first message,
which says where the sequence runs. Call failures raise `RemoteError` with the server's message and
status code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from services.engine.engine import GenerationRequest, StepOutput
from services.errors import AerieError
from services.rpc import codec
from services.rpc.channel import open_channel
from services.rpc.config import DEFAULT_MAX_MESSAGE_BYTES
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

    def __init__(self, address: str, tokenizer: Any | None, target_path: str, timeout_s: float | None) -> None:
        self.address = address
        self.channel = open_channel(address, DEFAULT_MAX_MESSAGE_BYTES)
        self.stub = coordinator_grpc.CoordinatorStub(self.channel)
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        self.target_path = target_path
        self.draft_path: str | None = None
        self.tree: TreeParams | None = None
        self.sequence_id: str | None = None
        self.placement: tuple[str, str] | None = None
        self.engine = RemoteEngine(self)

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


def local_tokenizer(target: str | None) -> tuple[Any | None, str]:
    """(tokenizer or None, the target path) without loading the model's weights."""
    from services.model.loading import converted_gguf_dir, find_default_gguf, load_tokenizer

    source = target or find_default_gguf()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = converted_gguf_dir(path)
    elif not path.is_dir():
        return None, source
    return load_tokenizer(path), source


def connect(address: str, target: str | None, timeout_s: float | None = None) -> RemoteSession:
    tokenizer, target_path = local_tokenizer(target)
    return RemoteSession(address, tokenizer, target_path, timeout_s)
