"""VerifierServicer: decode -> call `Verifier` -> encode. Nothing else lives here.

Model work runs on one worker thread, in arrival order (one forward at a time, as on one GPU), so
the event loop stays free for health checks and other calls. Each sequence's drafter decides which
features it needs (hidden / taps / none), so the servicer keeps one core `Verifier` per feature kind
over the same target and remembers which one holds each sequence.

Verify and Decode are idempotent per (sequence, round): the latest round's response is kept and a
repeated call (a retry after UNAVAILABLE) returns it instead of running the round twice.
"""

from __future__ import annotations


import torch

from services.engine.verifier import PrefillResult, Verifier
from services.errors import CapacityExceeded, InvalidRequest, SequenceNotFound
from services.metrics import PREFILL_SECONDS, SEQUENCES_IN_FLIGHT, VERIFY_SECONDS
from services.model.runner import ModelRunner
from services.model.target import TargetModel
from services.rpc import codec
from services.rpc.errors import rpc_errors
from services.rpc.reaper import IdleSequences, Reaper
from services.rpc.server import ModelWorker
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.sampling import SamplingParams
from services.spec.budget import CostCurve
from services.spec.tree import DraftTree
from verifier_svc.config import VerifierConfig

SERVICE = "verifier"


class VerifierServicer(verifier_grpc.VerifierServicer):
    SERVICE = SERVICE

    def __init__(self, target: TargetModel, config: VerifierConfig, target_path: str,
                 eos_token_ids: tuple[int, ...], verify_cost: CostCurve | None = None) -> None:
        """`verify_cost`: t_verify(rows) measured on this device, served by GetInfo for the budget."""
        self.verify_cost = verify_cost
        self.target = target
        self.config = config
        self.target_path = target_path
        self.eos_token_ids = eos_token_ids
        self.vocab_size = target.config.vocab_size
        # capacity = prompt + max_new_tokens (<= max_context) + one tree, capped by this server's config
        # (AERIE_MAX_SEQUENCE_ROWS / AERIE_MAX_TREE_NODES), never by the caller
        self.max_capacity = config.max_sequence_rows or target.config.max_context + config.max_tree_nodes
        # one runner (one KV pool) for every sequence, whatever features its drafter needs
        self.runner = ModelRunner(target)
        self._roles = {kind: Verifier(target, kind, config.max_sequences, self.runner)
                       for kind in ("hidden", "taps", "none")}
        self._kind: dict[str, str] = {}  # sequence id -> the feature kind (the Verifier holding it)
        self._last: dict[str, tuple[int, object]] = {}  # sequence id -> (round, response) for replays
        self._call = ModelWorker("verifier")  # every model call runs on this one thread
        self.idle = IdleSequences(config.idle_ttl_s)  # KV of a sequence nobody touches is reaped
        self.reaper = Reaper(SERVICE, self.idle, lambda seq_id: self._call.run(self._release, seq_id))

    def close(self) -> None:
        self.reaper.stop()
        self._call.close()

    @property
    def num_sequences(self) -> int:
        return len(self._kind)

    # ---- RPCs --------------------------------------------------------------------------------------

    @rpc_errors
    async def Prefill(self, request: vpb.VerifierPrefillRequest, context):
        seq_id = codec.sequence_id(request.sequence_id)
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty: give at least one token")
        if n > self.config.max_prompt_tokens and not request.rebuild:
            raise CapacityExceeded(f"prompt has {n} tokens; this verifier accepts at most "
                                   f"{self.config.max_prompt_tokens} (AERIE_MAX_PROMPT_TOKENS)")
        prompt = torch.tensor(codec.token_ids(request.prompt_ids, self.vocab_size, "prompt"), dtype=torch.long)
        sampling = codec.decode_sampling(request.sampling)
        kind = codec.feature_kind(request.feature_kind)
        if not n < request.capacity <= self.max_capacity:
            raise InvalidRequest(f"capacity must be in [{n + 1}, {self.max_capacity}] for a {n}-token prompt "
                                 f"(this verifier's limit, AERIE_MAX_SEQUENCE_ROWS); got {request.capacity}")
        result = await self._call.timed(PREFILL_SECONDS.labels(SERVICE),
                                              self._prefill, seq_id, kind, prompt, sampling, request.capacity)
        for i, chunk in enumerate(codec.tensor_chunks(result.features, self.config.service.chunk_bytes)):
            yield vpb.VerifierPrefillResponse(first_token=result.first_token if i == 0 else 0, features=chunk)

    @rpc_errors
    async def Verify(self, request: vpb.VerifyRequest, context) -> vpb.VerifyResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        tree = codec.decode_tree(request.tree, self.vocab_size, self.config.max_tree_nodes)
        response = await self._call.timed(VERIFY_SECONDS.labels(SERVICE),
                                              self._verify, seq_id, request.round_index, tree)
        return response

    @rpc_errors
    async def Decode(self, request: vpb.DecodeRequest, context) -> vpb.DecodeResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        token = codec.token_ids([request.token], self.vocab_size, "decode")[0]
        response = await self._call.timed(VERIFY_SECONDS.labels(SERVICE),
                                              self._decode, seq_id, request.round_index, token)
        return response

    @rpc_errors
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        return pb.ReleaseResponse(released=await self._call(self._release, seq_id))

    @rpc_errors
    async def GetInfo(self, request: pb.InfoRequest, context) -> vpb.VerifierInfo:
        cfg = self.target.config
        info = vpb.VerifierInfo(target=self.target_path, dtype=codec.dtype_name(self.target.dtype),
                                vocab_size=cfg.vocab_size, max_context=cfg.max_context,
                                eos_token_ids=list(self.eos_token_ids), max_sequences=self.config.max_sequences,
                                num_sequences=self.num_sequences, max_prompt_tokens=self.config.max_prompt_tokens)
        if self.verify_cost is not None:
            info.verify_cost.CopyFrom(codec.encode_cost(self.verify_cost))
        return info

    # ---- on the worker thread ------------------------------------------------------------------------

    def _prefill(self, seq_id: str, kind: str, prompt: torch.Tensor, sampling: SamplingParams,
                 capacity: int) -> PrefillResult:
        if seq_id in self._kind:
            raise InvalidRequest(f"sequence {seq_id!r} already exists on this verifier")
        if len(self._kind) >= self.config.max_sequences:
            raise CapacityExceeded(f"verifier holds its maximum of {self.config.max_sequences} sequences "
                                   f"(AERIE_MAX_SEQUENCES)")
        result = self._roles[kind].prefill(seq_id, prompt, sampling, capacity)
        self._kind[seq_id] = kind
        self.idle.touch(seq_id)
        SEQUENCES_IN_FLIGHT.labels(SERVICE).set(len(self._kind))
        return result

    def _verify(self, seq_id: str, round_index: int, tree: DraftTree) -> vpb.VerifyResponse:
        replay = self._replay(seq_id, round_index)
        if replay is not None:
            return replay
        response = codec.encode_verify_result(self._role(seq_id).verify(seq_id, tree, round_index))
        self._last[seq_id] = (round_index, response)
        return response

    def _decode(self, seq_id: str, round_index: int, token: int) -> vpb.DecodeResponse:
        replay = self._replay(seq_id, round_index)
        if replay is not None:
            return replay
        response = vpb.DecodeResponse(token=self._role(seq_id).decode(seq_id, token, round_index))
        self._last[seq_id] = (round_index, response)
        return response

    def _release(self, seq_id: str) -> bool:
        kind = self._kind.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self.idle.forget(seq_id)
        if kind is not None:
            self._roles[kind].release(seq_id)
        SEQUENCES_IN_FLIGHT.labels(SERVICE).set(len(self._kind))
        return kind is not None

    def _role(self, seq_id: str) -> Verifier:
        kind = self._kind.get(seq_id)
        if kind is None:
            raise SequenceNotFound(f"unknown sequence {seq_id!r} on this verifier")
        self.idle.touch(seq_id)
        return self._roles[kind]

    def _replay(self, seq_id: str, round_index: int):
        """The stored response when `round_index` is the latest round again; None for a new round."""
        self._role(seq_id)
        last = self._last.get(seq_id)
        if last is None or round_index > last[0]:
            return None
        if round_index == last[0]:
            return last[1]
        raise InvalidRequest(f"round {round_index} of sequence {seq_id!r} is older than its latest round {last[0]}")


def _check_round(round_index: int) -> None:
    if round_index < 1:
        raise InvalidRequest(f"round_index must be >= 1 (0 is the prefill); got {round_index}")
