"""A prefill longer than one deadline (issue: "Long prompts", item 1), over real gRPC and a real Redis.

The coordinator sends a long prompt chunk by chunk (the verifier's --prefill-chunk, 8 rows here, so a
40-token prompt is 5 chunks), each chunk its own AERIE_RPC_TIMEOUT_S deadline. The "slow verifier" is
the real one whose forward of one chunk is held on the worker thread until the coordinator has seen
that chunk's deadline expire (its aerie_prefill_chunk_timeouts_total counter moved): no test depends
on how fast anything runs, only on that order of events.

- a chunk that outlives its deadline is sent again to the same verifier, which answers it from its
  stored answer: every chunk runs exactly once, nothing moves, the tokens are those of an undisturbed run;
- a chunk that misses AERIE_PREFILL_TRIES deadlines fails the sequence once, with DEADLINE_EXCEEDED
  naming the chunk, and frees its KV;
- Cancel (or the client going away) while a chunk runs stops the prefill before the next chunk;
- a sequence that asks for logprobs gets the first token's with the last chunk's answer, also when
  that chunk is answered again from its stored answer.
"""

import threading

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from services.engine.engine import GenerationRequest
from services.engine.verifier import PrefillCall, PrefillMoreCall
from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.spec.logprobs import TokenLogprobs
from services.spec.sampling import SamplingParams
from tests.pipeline import local_engine, local_run, remote_run, start_pipeline, wait_until

PROMPT = [(7 * i + 3) % 100 + 1 for i in range(40)]  # 5 chunks of 8 rows: offsets 0, 8, 16, 24, 32
SLOW = 16  # the chunk held on the verifier
DEADLINE_S = 3.0  # the coordinator's AERIE_RPC_TIMEOUT_S here (a held chunk costs this much wall time)


def timeouts() -> float:
    return REGISTRY.get_sample_value("aerie_prefill_chunk_timeouts_total", {"service": "coordinator"}) or 0.0


def failovers() -> float:
    return sum(REGISTRY.get_sample_value("aerie_failovers_total", {"service": "coordinator", "role": "verifier",
                                                                    "reason": r}) or 0.0
               for r in ("unavailable", "deadline_exceeded", "not_found"))


class SlowChunk:
    """Wraps the verifier's forward: counts the forwards of each prefill chunk (by its first row)
    and holds the forward of the chunk at row `at` until `release()` returns True (polled on the
    worker thread)."""

    def __init__(self, servicer, at: int = SLOW) -> None:
        self.at = at
        self.engine = servicer.verifier
        self.run = self.engine.run
        self.rows: dict[str, int] = {}  # prompt rows each sequence holds, as the forwards saw them
        self.forwards: dict[int, int] = {}  # chunk offset -> forwards
        self.release = lambda: True
        self.held = threading.Event()  # set when the SLOW chunk's forward is being held
        self.engine.run = self._run

    def _run(self, calls):
        for c in calls:
            if isinstance(c, (PrefillCall, PrefillMoreCall)):
                offset = 0 if isinstance(c, PrefillCall) else self.rows[c.seq_id]
                self.rows[c.seq_id] = offset + c.rows
                self.forwards[offset] = self.forwards.get(offset, 0) + 1
                if offset == self.at:
                    self.held.set()
                    wait_until(self.release, timeout=60)
        return self.run(calls)

    def undo(self) -> None:
        self.engine.run = self.run


@pytest.fixture()
def pipeline(model_dirs, redis_url, request):
    tries = getattr(request, "param", 3)
    p = start_pipeline(model_dirs, redis_url, verifier_overrides={"prefill_chunk": 8}, rpc_timeout_s=DEADLINE_S,
                       prefill_tries=tries)
    yield p
    p.close()


def generate(p, seq_id: str):
    return p.coordinator_stub().Generate(cpb.GenerateRequest(
        prompt_ids=PROMPT, max_new_tokens=12, ignore_eos=True, sequence_id=seq_id,
        sampling=pb.SamplingParams()), timeout=120)


def test_a_chunk_that_outlives_its_deadline_is_sent_again_and_runs_once(pipeline):
    expected = [t for m in generate(pipeline, "a" * 32) for t in m.tokens]  # undisturbed
    slow = SlowChunk(pipeline.verifier)
    t0, f0 = timeouts(), failovers()
    slow.release = lambda: timeouts() >= t0 + 1  # the coordinator gave up on the first call
    try:
        messages = list(generate(pipeline, "b" * 32))
    finally:
        slow.undo()
    assert [t for m in messages for t in m.tokens] == expected
    assert messages[-1].finish_reason == "length"
    assert slow.forwards == {0: 1, 8: 1, 16: 1, 24: 1, 32: 1}  # resumed, never from row 0 again
    assert timeouts() == t0 + 1 and failovers() == f0  # a slow verifier is not a dead one
    assert pipeline.coordinator.store.get("b" * 32).verifier == pipeline.addresses["verifier"]


@pytest.mark.parametrize("pipeline", [2], indirect=True)
def test_a_chunk_that_misses_every_try_fails_the_sequence_once_precisely(pipeline):
    slow = SlowChunk(pipeline.verifier)
    t0, f0 = timeouts(), failovers()
    slow.release = lambda: timeouts() >= t0 + 2  # held through both tries
    seq_id = "c" * 32
    try:
        with pytest.raises(grpc.RpcError) as failed:
            list(generate(pipeline, seq_id))
    finally:
        slow.undo()
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = failed.value.details()
    assert "prefill chunk 3 of 5 (rows 16..23)" in details and "2 times" in details, details
    assert "AERIE_PREFILL_TRIES" in details and "16 of 40 rows" in details, details
    assert timeouts() == t0 + 2 and failovers() == f0
    assert slow.forwards.get(24, 0) == 0 and slow.forwards[0] == 1 and slow.forwards[8] == 1
    state = pipeline.coordinator.store.get(seq_id)
    assert state.status == "failed" and state.tokens == [] and "chunk 3 of 5" in state.error
    wait_until(lambda: pipeline.verifier.num_sequences == 0)  # the partial prefill's KV is freed


@pytest.mark.parametrize("how", ["cancel", "client_leaves"])
def test_cancel_stops_a_prefill_within_one_chunk(pipeline, how):
    slow = SlowChunk(pipeline.verifier)
    go = threading.Event()
    slow.release = go.is_set
    seq_id = ("d" if how == "cancel" else "e") * 32
    stream = generate(pipeline, seq_id)
    received: list = []
    reader = threading.Thread(target=lambda: received.extend(_drain(stream)), daemon=True)
    reader.start()
    try:
        assert slow.held.wait(60)  # chunk 3 of 5 is in its forward
        if how == "cancel":
            reply = pipeline.coordinator_stub().Cancel(cpb.CancelRequest(sequence_id=seq_id), timeout=10)
            assert reply.status == cpb.SEQUENCE_STATUS_RUNNING
        else:
            stream.cancel()
            wait_until(lambda: all(r.cancelled.is_set() for r in pipeline.coordinator.sequences.runs()))
    finally:
        go.set()
        reader.join(60)
        slow.undo()
    wait_until(lambda: pipeline.coordinator.store.get(seq_id).status == "cancelled")
    state = pipeline.coordinator.store.get(seq_id)
    assert (state.finish_reason, state.tokens) == ("cancel", [])
    assert slow.forwards.get(24, 0) == 0 and slow.forwards.get(32, 0) == 0  # stopped before the next chunk
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and len(pipeline.coordinator.sequences) == 0)
    if how == "cancel":  # the stream ends with a last message: no tokens, finish_reason "cancel"
        assert [(list(m.tokens), m.finish_reason) for m in received] == [([], "cancel")]


def test_logprobs_come_with_the_last_chunk_also_when_it_is_sent_again(pipeline, model_dirs):
    """The first token's logprobs ride on the last chunk's answer; here that chunk outlives its
    deadline and the second call is answered from its stored answer, logprobs included. Every
    message's logprobs are the in-process engine's (one whole-prompt prefill)."""
    sampling = SamplingParams(logprobs=2)
    req = GenerationRequest(tuple(PROMPT), 12, sampling, ignore_eos=True)
    want = TokenLogprobs.cat([out.logprobs for out in local_engine(model_dirs).generate(req)])
    slow = SlowChunk(pipeline.verifier, at=32)  # the last of the 5 chunks
    t0 = timeouts()
    slow.release = lambda: timeouts() >= t0 + 1  # the coordinator gave up on the first call
    try:
        messages = list(pipeline.coordinator_stub().Generate(cpb.GenerateRequest(
            prompt_ids=PROMPT, max_new_tokens=12, ignore_eos=True, sequence_id="f" * 32,
            sampling=codec.encode_sampling(sampling)), timeout=120))
    finally:
        slow.undo()
    assert slow.forwards[32] == 1 and timeouts() == t0 + 1  # sent twice, run once
    assert messages[0].stats.round_index == 0 and messages[0].logprobs.token_ids == messages[0].tokens
    got = TokenLogprobs.cat([codec.decode_logprobs(m.logprobs, m.tokens) for m in messages])
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert torch.equal(got.top_ids, want.top_ids)


def _drain(stream):
    try:
        yield from stream
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            raise


@pytest.mark.parametrize("with_drafter", [True, False], ids=["drafter", "plain"])
def test_a_prompt_sent_in_chunks_gives_the_in_process_tokens(model_dirs, redis_url, with_drafter):
    """The coordinator's chunks (5 calls here), their features joined for the drafter (or none, for
    plain decoding), give exactly the in-process engine's greedy tokens (one whole-prompt prefill)."""
    req = GenerationRequest(tuple(PROMPT), 24, SamplingParams(), ignore_eos=True)
    expected = local_run(local_engine(model_dirs, with_drafter=with_drafter), req)[0]
    p = start_pipeline(model_dirs, redis_url, with_drafter=with_drafter, verifier_overrides={"prefill_chunk": 8})
    slow = SlowChunk(p.verifier)  # nothing held: it only counts the forwards
    try:
        assert remote_run(p, req)[0] == expected
        assert slow.forwards == {0: 1, 8: 1, 16: 1, 24: 1, 32: 1}
    finally:
        slow.undo()
        p.close()
