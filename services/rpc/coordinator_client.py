"""A client of the Coordinator API shaped like the in-process engine, so `aerie generate` prints the
same output either way:

    session = connect("127.0.0.1:50051", target=None)
    for out in session.engine.generate(GenerationRequest(...)):    # RoundOutput per committed round
        ...

The tokenizer is the served target's (GetInfo names it; `connect` refuses a --target that names
another model), loaded locally without the weights (services/text.py): the services hold the
models, the client only encodes the prompt and decodes the text. `draft_path` and `tree` are filled from the first message,
which says where the sequence runs. Call failures raise `RemoteError` with the server's message and
status code.

A stream whose coordinator drains (SIGTERM) or dies breaks with UNAVAILABLE; the engine then Resumes
the sequence by itself on the next of the session's addresses (`connect("a:1,b:2", ...)`), from the
number of tokens it already yielded, so the caller sees one stream with no gap and no duplicate
(`session.resumes` counts it; `resume_s=0` turns it off).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from services.engine.engine import GenerationRequest, RoundOutput
from services.errors import AerieError, InvalidRequest
from services.rpc import codec
from services.rpc.channel import open_channel
from services.rpc.security import Security
from services.rpc.config import DEFAULT_MAX_MESSAGE_BYTES, endpoint_problem
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from services.spec.tree import TreeParams


class RemoteError(AerieError):
    """A Coordinator call failed; `code` is its gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


RESUME_S = 60.0  # default time a broken stream keeps trying to Resume (0 = never)
BACKOFF_S = (0.2, 2.0)  # the wait before the first Resume try, doubling up to the second


def parse_addresses(value: str | Sequence[str], what: str = "--coordinator") -> tuple[str, ...]:
    """`"a:1,b:2"` (or a list) -> ("a:1", "b:2"): HOST:PORT entries, an IPv6 host in brackets
    (`[::1]:50051`). Raises InvalidRequest naming the entry that is not one."""
    text = value if isinstance(value, str) else ",".join(value)
    entries = value.split(",") if isinstance(value, str) else list(value)
    if not entries or all(not e.strip() for e in entries):
        raise InvalidRequest(f"{what} {text!r} is empty: give HOST:PORT, or several as HOST:PORT,HOST:PORT")
    out = []
    for raw in entries:
        entry = raw.strip()
        problem = endpoint_problem(entry) if entry else "an empty entry (two commas, or a comma at an end)"
        if problem:
            raise InvalidRequest(f"{what} {text!r}: entry {raw!r} is {problem}")
        out.append(entry)
    return tuple(out)


class RemoteEngine:
    def __init__(self, session: RemoteSession) -> None:
        self._session = session

    def generate(self, req: GenerationRequest, seq_id: str | None = None) -> Iterator[RoundOutput]:
        """One continuous stream of the sequence's RoundOutputs. When the stream breaks with
        UNAVAILABLE after the sequence id is known (a coordinator that drains or dies), it calls
        Resume(sequence_id, from_token_index=<tokens received>) on the next address (backoff 0.2 s
        doubling to 2 s, for up to `session.resume_s` per outage), so no token is missed or repeated.
        A sequence that itself failed with UNAVAILABLE (no verifier left) costs one Resume try, which
        answers ABORTED at once: the stream's own error is raised then, unchanged.
        A Resume stream's messages carry no round statistics (their accept_length is 0)."""
        s = self._session
        s.sequence_id = None  # until this stream's first message names it
        deadline = None if s.timeout_s is None else time.monotonic() + s.timeout_s
        call = s.stub.Generate(codec.encode_generation_request(req, seq_id or ""), timeout=s.timeout_s)
        received = 0  # tokens yielded so far: the Resume index
        outage: _Outage | None = None  # since the stream broke, until a Resume stream answers
        try:
            while True:
                try:
                    for msg in call:
                        if msg.HasField("info"):
                            s.sequence_id = msg.sequence_id
                            s.placement = (msg.info.placement.drafter, msg.info.placement.verifier)
                            s.draft_path = msg.info.draft or None
                            s.tree = codec.decode_tree_params(msg.info.tree) if msg.info.HasField("tree") else None
                        if outage is not None:  # a Resume stream answers: the outage is over
                            s.resumed_at.append((s.address, outage.from_index))
                            outage = None
                        received += len(msg.tokens)
                        yield RoundOutput(list(msg.tokens), codec.decode_stats(msg.stats), msg.finish_reason or None,
                                          codec.decode_logprobs(msg.logprobs, msg.tokens)
                                          if msg.HasField("logprobs") else None,
                                          codec.decode_logprobs(msg.prompt_logprobs, None)
                                          if msg.HasField("prompt_logprobs") else None)
                    if outage is not None:  # a Resume stream that ended at once: the sequence had ended
                        s.resumed_at.append((s.address, outage.from_index))
                    return
                except grpc.RpcError as e:
                    code, details = e.code(), e.details() or str(e)
                    if code == grpc.StatusCode.ABORTED and outage is not None:
                        # a Resume that says the sequence failed before it delivered anything: the
                        # break was the sequence's own failure (e.g. no verifier), not its coordinator's
                        raise outage.error from None
                    if code != grpc.StatusCode.UNAVAILABLE or not s.sequence_id or s.resume_s <= 0:
                        raise RemoteError(code, details) from None
                    if outage is None:
                        outage = _Outage(time.monotonic() + s.resume_s, received, RemoteError(code, details))
                        s.breaks.append(details)
                    wait = outage.next_wait()
                    if time.monotonic() + wait > outage.give_up:
                        raise RemoteError(code, f"{details} (gave up resuming sequence {s.sequence_id!r} at "
                                                f"token {received} after {s.resume_s:g} s: {outage.tries} Resume "
                                                f"tries on {', '.join(s.addresses)})") from None
                    time.sleep(wait)
                    s.use(s.index + 1)  # the next address (the same one when there is one)
                    outage.tries += 1
                    s.resume_tries += 1
                    left = None if deadline is None else max(1.0, deadline - time.monotonic())
                    call = s.stub.Resume(cpb.ResumeRequest(sequence_id=s.sequence_id, from_token_index=received),
                                         timeout=left)
        finally:
            call.cancel()  # no-op after a normal end; tells the coordinator when the reader stops early


class _Outage:
    """One break of the stream: when to give up, where it broke, its error, the backoff."""

    def __init__(self, give_up: float, from_index: int, error: RemoteError) -> None:
        self.give_up = give_up
        self.from_index = from_index
        self.error = error
        self.tries = 0
        self._wait = BACKOFF_S[0]

    def next_wait(self) -> float:
        wait, self._wait = self._wait, min(2 * self._wait, BACKOFF_S[1])
        return wait


class RemoteSession:
    """What `aerie generate` needs from an engine: `.engine.generate`, `.tokenizer`, paths, tree.

    `address`: HOST:PORT, or several (`"a:1,b:2"` or a list) that a broken stream Resumes on in
    turn (one address behind a load balancer, e.g. a Kubernetes Service, is retried as it is).
    `resume_s`: how long a broken stream keeps trying (0 = never: it raises RemoteError)."""

    def __init__(self, address: str | Sequence[str], tokenizer: Any | None, target_path: str, timeout_s: float | None,
                 security: Security | None = None, resume_s: float = RESUME_S) -> None:
        """`security`: TLS and the API token; default from AERIE_TLS_CA (+ AERIE_TLS_CERT/KEY) and
        AERIE_API_TOKEN (services/rpc/security.py)."""
        if resume_s < 0:
            raise InvalidRequest(f"resume_s must be >= 0 (0 = never resume); got {resume_s}")
        self.addresses = parse_addresses(address)
        self._security = security if security is not None else Security.client_from_env()
        self._channels: dict[str, grpc.Channel] = {}
        self.index = 0
        self.timeout_s = timeout_s
        self.resume_s = resume_s
        self.tokenizer = tokenizer
        self.target_path = target_path
        self.dtype: str | None = None  # as the verifiers report it (GetInfo)
        self.draft_path: str | None = None
        self.tree: TreeParams | None = None
        self.sequence_id: str | None = None
        self.placement: tuple[str, str] | None = None
        self.resumed_at: list[tuple[str, int]] = []  # (address, from_token_index) of each Resume that answered
        self.resume_tries = 0  # Resume calls made, the failed ones included
        self.breaks: list[str] = []  # the UNAVAILABLE message that broke the stream, once per outage
        self.engine = RemoteEngine(self)
        self.use(0)

    @property
    def resumes(self) -> int:
        """How many times a broken stream was resumed."""
        return len(self.resumed_at)

    def use(self, index: int) -> None:
        """Talk to addresses[index % len] from now on (its channel is opened once and kept)."""
        self.index = index % len(self.addresses)
        self.address = self.addresses[self.index]
        if self.address not in self._channels:
            self._channels[self.address] = open_channel(self.address, DEFAULT_MAX_MESSAGE_BYTES, self._security)
        self.channel = self._channels[self.address]
        self.stub = coordinator_grpc.CoordinatorStub(self.channel)

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
        for channel in self._channels.values():
            channel.close()


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
    from services.model.hub import cached

    if cached(served) is not None:  # `aerie up`, a cluster sharing the file system, a Hub id in the local cache
        return served
    try:
        default = find_default_gguf()
    except AerieError:
        return None
    return default if same_model(default, served) else None


def connect(address: str | Sequence[str], target: str | None, timeout_s: float | None = None,
            resume_s: float = RESUME_S) -> RemoteSession:
    """A session whose tokenizer is the served target's (checked with the coordinator's GetInfo), or
    None when this machine has no copy of it (then only --prompt-ids work). With several addresses
    the session starts on the first one whose GetInfo answers (UNAVAILABLE: the next one)."""
    from services.text import load_tokenizer

    session = RemoteSession(address, None, "", timeout_s, resume_s=resume_s)
    try:
        for i in range(len(session.addresses)):
            session.use(i)
            try:
                served = session.get_info()
                break
            except RemoteError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or i == len(session.addresses) - 1:
                    raise
        session.target_path = served.target
        session.dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(served.dtype, served.dtype)
        source = served_tokenizer_source(target, served.target, session.address)
        session.tokenizer = load_tokenizer(source) if source is not None else None
    except BaseException:
        session.close()
        raise
    return session
