"""VerifierServicer: decode -> call `Verifier` -> encode. Nothing else lives here.

Model work runs on one worker thread (services/engine/batcher.py), so the event loop stays free for
health checks and other calls. Continuous batching: the Prefill, Verify and Decode calls that arrive
while a forward runs are gathered, in arrival order, into the next forward (`Verifier.run`: one
target forward for all of them, up to --max-batch calls and --max-batch-rows rows); a call that
fails (unknown sequence, KV that does not fit, ...) fails alone. Release runs between batches. Each
sequence's drafter decides which features it needs (hidden / taps / none, given at Prefill).

Verify and Decode are idempotent per (sequence, round): the latest round's response is kept and a
repeated call (a retry after UNAVAILABLE) returns it instead of running the round twice.
"""

from __future__ import annotations

import time

import torch

from services.engine.batcher import Batcher, BatchStats
from services.engine.verifier import Call, DecodeCall, PrefillCall, Verifier, VerifyCall
from services.errors import CapacityExceeded, InvalidRequest, SequenceNotFound
from services.metrics import (BATCH_QUEUE, BATCH_ROWS, BATCH_SIZE, PREFILL_SECONDS, SEQUENCES_IN_FLIGHT,
                              VERIFY_SECONDS)
from services.model.runner import ModelRunner
from services.model.target import TargetModel
from services.rpc import codec
from services.rpc.errors import rpc_errors
from services.rpc.reaper import IdleSequences, Reaper
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.budget import CostCurve
from verifier_svc.config import VerifierConfig

SERVICE = "verifier"


class VerifierServicer(verifier_grpc.VerifierServicer):
    SERVICE = SERVICE

    def __init__(self, target: TargetModel, config: VerifierConfig, target_path: str,
                 eos_token_ids: tuple[int, ...], verify_cost: CostCurve | None = None,
                 runner: ModelRunner | None = None) -> None:
        """`verify_cost`: t_verify(rows) measured on this device, served by GetInfo for the budget;
        `runner`: the model runner (None: a local ModelRunner over `target`)."""
        self.verify_cost = verify_cost
        self.target = target
        self.config = config
        self.target_path = target_path
        self.eos_token_ids = eos_token_ids
        self.vocab_size = target.config.vocab_size
        # capacity = prompt + max_new_tokens (<= max_context) + one tree, capped by this server's config
        # (AERIE_MAX_SEQUENCE_ROWS / AERIE_MAX_TREE_NODES), never by the caller
        self.max_capacity = config.max_sequence_rows or target.config.max_context + config.max_tree_nodes
        # one runner (one KV pool) and one Verifier for every sequence, whatever features it returns
        self.runner = runner if runner is not None else ModelRunner(target)
        self.verifier = Verifier(target, "hidden", config.max_sequences, self.runner)
        self._kind: dict[str, str] = {}  # sequence id -> the feature kind its drafter needs
        self.group = runner if getattr(runner, "world", 1) > 1 else None  # a TP group: its `alive` drives health
        self._last: dict[str, tuple[int, object]] = {}  # sequence id -> (round, response) for replays
        self.batcher: Batcher[Call] = Batcher("verifier", self._run_batch, rows=lambda c: c.rows,
                                              key=lambda c: c.seq_id, limits=config.batch,
                                              on_batch=_observe_batch, expect=lambda: len(self._kind))
        self.idle = IdleSequences(config.idle_ttl_s)  # KV of a sequence nobody touches is reaped
        self.reaper = Reaper(SERVICE, self.idle, lambda seq_id: self.batcher.run(self._release, seq_id))

    def close(self) -> None:
        self.reaper.stop()
        self.batcher.close()
        if self.group is not None:
            self.group.close()
            watcher = getattr(self, "watcher", None)  # verifier_svc/server.py watch_group
            if watcher is not None and not watcher.done():
                watcher.get_loop().call_soon_threadsafe(watcher.cancel)

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
        result = await _timed(PREFILL_SECONDS.labels(SERVICE), self.batcher.call_async(
            PrefillCall(seq_id, prompt, sampling, request.capacity, kind)))
        for i, chunk in enumerate(codec.tensor_chunks(result.features, self.config.service.chunk_bytes)):
            yield vpb.VerifierPrefillResponse(first_token=result.first_token if i == 0 else 0, features=chunk)

    @rpc_errors
    async def Verify(self, request: vpb.VerifyRequest, context) -> vpb.VerifyResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        tree = codec.decode_tree(request.tree, self.vocab_size, self.config.max_tree_nodes)
        return await _timed(VERIFY_SECONDS.labels(SERVICE),
                            self.batcher.call_async(VerifyCall(seq_id, tree, request.round_index)))

    @rpc_errors
    async def Decode(self, request: vpb.DecodeRequest, context) -> vpb.DecodeResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        _check_round(request.round_index)
        token = codec.token_ids([request.token], self.vocab_size, "decode")[0]
        return await _timed(VERIFY_SECONDS.labels(SERVICE),
                            self.batcher.call_async(DecodeCall(seq_id, token, request.round_index)))

    @rpc_errors
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        seq_id = codec.sequence_id(request.sequence_id)
        return pb.ReleaseResponse(released=await self.batcher.exclusive_async(self._release, seq_id))

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

    def _run_batch(self, calls: list[Call]) -> list:
        """One forward for every call that needs one; replays, unknown sequences and full capacity
        answer alone. Returns a response (or an exception) per call, in order."""
        results: list = [None] * len(calls)
        todo: list[int] = []
        admitted = 0
        for i, call in enumerate(calls):
            try:
                if isinstance(call, PrefillCall):
                    if call.seq_id in self._kind:
                        raise InvalidRequest(f"sequence {call.seq_id!r} already exists on this verifier")
                    if len(self._kind) + admitted >= self.config.max_sequences:
                        raise CapacityExceeded(f"verifier holds its maximum of {self.config.max_sequences} "
                                               f"sequences (AERIE_MAX_SEQUENCES)")
                    admitted += 1
                else:
                    replay = self._replay(call.seq_id, call.round_index)
                    if replay is not None:
                        results[i] = replay
                        continue
            except Exception as e:  # noqa: BLE001 (this call's answer)
                results[i] = e
                continue
            todo.append(i)
        if todo:
            for i, out in zip(todo, self.verifier.run([calls[i] for i in todo])):
                results[i] = out if isinstance(out, BaseException) else self._respond(calls[i], out)
        return results

    def _respond(self, call: Call, out):
        if isinstance(call, PrefillCall):
            self._kind[call.seq_id] = call.feature_kind
            self.idle.touch(call.seq_id)
            SEQUENCES_IN_FLIGHT.labels(SERVICE).set(len(self._kind))
            return out
        if isinstance(call, VerifyCall):
            response = codec.encode_verify_result(out)
        else:
            response = vpb.DecodeResponse(token=out)
        self._last[call.seq_id] = (call.round_index, response)
        return response

    def _release(self, seq_id: str) -> bool:
        kind = self._kind.pop(seq_id, None)
        self._last.pop(seq_id, None)
        self.idle.forget(seq_id)
        self.verifier.release(seq_id)
        SEQUENCES_IN_FLIGHT.labels(SERVICE).set(len(self._kind))
        return kind is not None

    def _check(self, seq_id: str) -> None:
        if seq_id not in self._kind:
            raise SequenceNotFound(f"unknown sequence {seq_id!r} on this verifier")
        self.idle.touch(seq_id)

    def _replay(self, seq_id: str, round_index: int):
        """The stored response when `round_index` is the latest round again; None for a new round."""
        self._check(seq_id)
        last = self._last.get(seq_id)
        if last is None or round_index > last[0]:
            return None
        if round_index == last[0]:
            return last[1]
        raise InvalidRequest(f"round {round_index} of sequence {seq_id!r} is older than its latest round {last[0]}")


async def _timed(histogram, awaitable):
    """Await and observe the wall time (queueing and batching included) in `histogram`."""
    t0 = time.perf_counter()
    try:
        return await awaitable
    finally:
        histogram.observe(time.perf_counter() - t0)


def _observe_batch(stats: BatchStats) -> None:
    BATCH_SIZE.labels(SERVICE).observe(stats.size)
    BATCH_ROWS.labels(SERVICE).observe(stats.rows)
    BATCH_QUEUE.labels(SERVICE).set(stats.waiting)


def _check_round(round_index: int) -> None:
    if round_index < 1:
        raise InvalidRequest(f"round_index must be >= 1 (0 is the prefill); got {round_index}")
