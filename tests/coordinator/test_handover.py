"""Coordinator hand-over and Resume over real gRPC and a real Redis.

A dead coordinator leaves exactly this in Redis: a running sequence, its committed rounds and a lease
that stops being renewed. Another coordinator takes it over once the lease expires, rebuilds it on
its replicas and finishes it; a client that Resumes through any coordinator gets exactly the tokens
it has not seen, equal to the undisturbed run's. A wrong id reads or resumes nothing."""

import time

import grpc
import pytest

from coordinator.sequence_store import LeaseLost, SequenceParams, SequenceRecord
from coordinator.server import Coordinator
from services.engine.engine import GenerationRequest
from services.rpc.coordinator_client import RemoteSession
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from services.spec.sampling import SamplingParams
from tests.pipeline import local_engine, local_run, start_pipeline

PROMPT = (5, 17, 99, 3, 42, 8)


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, lease_ttl_s=0.6, draft_dtype="fp32")  # see test_failover.DRAFT_DTYPE
    yield p
    p.close()


def resume(p, seq_id, start, address=None):
    stub = coordinator_grpc.CoordinatorStub(p.channel_to(address or p.addresses["coordinator"]))
    tokens, last = [], None
    for msg in stub.Resume(cpb.ResumeRequest(sequence_id=seq_id, from_token_index=start), timeout=60):
        assert msg.sequence_id == seq_id
        tokens += msg.tokens
        last = msg
    return tokens, last.finish_reason


# "penalised": the taker-over rebuilds min_p and the repetition penalty from the stored SequenceParams
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.8, 0.95, 0, 7),
                                      SamplingParams(0.8, 0.95, 0, 8, min_p=0.05, repetition_penalty=1.3)],
                         ids=["greedy", "seeded", "penalised"])
def test_a_dead_coordinators_sequence_is_taken_over_and_resumed(pipeline, model_dirs, sampling):
    req = GenerationRequest(PROMPT, 60, sampling, ignore_eos=True)
    steps = list(local_engine(model_dirs, draft_dtype="fp32").generate(req))
    expected = [t for s in steps for t in s.tokens]
    # what a coordinator that died after round 4 leaves behind
    store = pipeline.coordinator.store
    seq_id = f"dead-{sampling.seed}-{int(sampling.greedy)}"
    store.create(SequenceRecord(seq_id, PROMPT, SequenceParams(60, sampling.temperature, sampling.top_p, sampling.top_k,
                                                               ignore_eos=True, min_p=sampling.min_p,
                                                               repetition_penalty=sampling.repetition_penalty),
                                sampling.seed, "gone:1", "gone:2", owner="dead-coordinator"))
    for s in steps[:5]:
        store.commit(seq_id, s.stats.round_index, s.tokens, None, owner="dead-coordinator")
    seen = [t for s in steps[:3] for t in s.tokens]  # the client had received rounds 0-2 only
    t0 = time.monotonic()
    tokens, reason = resume(pipeline, seq_id, len(seen))
    assert seen + tokens == expected and reason == "length"
    assert time.monotonic() - t0 < 120  # no hang (a bound for a failing test: load makes it slow, not wrong)
    state = store.get(seq_id)
    assert state.owner == pipeline.coordinator.sequences.owner and state.tokens == expected
    assert state.verifier == pipeline.addresses["verifier"]  # the new placement is recorded
    # the dead coordinator cannot commit any more: its lease is gone (fencing)
    with pytest.raises(Exception):
        store.commit(seq_id, 99, [1], None, owner="dead-coordinator")


def test_commits_are_fenced_by_the_lease(pipeline):
    store = pipeline.coordinator.store
    store.create(SequenceRecord("fenced-1", PROMPT, SequenceParams(9, 0.0, 1.0, 0), 0, "", "v:1", owner="a"))
    store.commit("fenced-1", 0, [1], None, owner="a")
    with pytest.raises(LeaseLost):
        store.commit("fenced-1", 1, [2], None, owner="b")  # a's lease is live
    assert not store.claim("fenced-1", "b")
    store.finish("fenced-1", "cancelled", "cancel")


def test_resume_through_another_coordinator_while_it_runs(pipeline, model_dirs, redis_url):
    _, other = pipeline.add_coordinator(redis_url)
    req = GenerationRequest(PROMPT, 50, SamplingParams(0.7, 1.0, 0, 3), ignore_eos=True)
    session = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=60)
    steps = session.engine.generate(req)
    got = list(next(steps).tokens) + list(next(steps).tokens)
    tokens, reason = resume(pipeline, session.sequence_id, len(got), other)
    assert got + tokens == local_run(local_engine(model_dirs, draft_dtype="fp32"), req)[0] and reason == "length"
    steps.close()
    session.close()


def test_a_wrong_id_reads_and_resumes_nothing(pipeline):
    session = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=60)
    list(session.engine.generate(GenerationRequest(PROMPT, 5)))
    seq_id = session.sequence_id
    assert len(seq_id) == 32 and int(seq_id, 16) >= 0  # 128 random bits, made by the coordinator
    stub = pipeline.coordinator_stub()
    for wrong in (seq_id[:-1] + ("0" if seq_id[-1] != "0" else "1"), seq_id[:16], seq_id.upper()):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Resume(cpb.ResumeRequest(sequence_id=wrong), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and repr(wrong) in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.GetSequence(cpb.GetSequenceRequest(sequence_id=wrong), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(stub.GetSequence(cpb.GetSequenceRequest(sequence_id=seq_id), timeout=10).tokens) == 5
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Resume(cpb.ResumeRequest(sequence_id=seq_id, from_token_index=6), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "from_token_index 6" in e.value.details()
    session.close()


def test_a_take_over_before_the_prefill_commit_reuses_a_verifier_that_holds_the_old_kv(pipeline, model_dirs):
    """A coordinator that died between its Prefill and the commit of its first token leaves a record
    with no tokens and, on the verifier, KV under the sequence's id. The coordinator that takes it
    over starts it again on that verifier: it releases the old KV first instead of failing with
    'already exists', and the output is the undisturbed run's."""
    import torch

    req = GenerationRequest(PROMPT, 30, SamplingParams(), ignore_eos=True)
    expected = local_run(local_engine(model_dirs, draft_dtype="fp32"), req)[0]
    store = pipeline.coordinator.store
    seq_id = "died-before-its-first-commit"
    address = pipeline.addresses["verifier"]
    store.create(SequenceRecord(seq_id, PROMPT, SequenceParams(30, 0.0, 1.0, 0, ignore_eos=True),
                                0, "", address, owner="dead-coordinator"))
    client = next(c for c in pipeline.coordinator.sequences.verifiers.clients() if c.address == address)
    client.for_sequence("hidden").prefill(seq_id, torch.tensor(PROMPT), SamplingParams(), 64)  # the old KV
    with pytest.raises(Exception, match="already exists"):  # what the take-over used to hit
        client.for_sequence("hidden").prefill(seq_id, torch.tensor(PROMPT), SamplingParams(), 64)
    tokens, reason = resume(pipeline, seq_id, 0)
    assert tokens == expected and reason == "length"
    state = store.get(seq_id)
    assert state.owner == pipeline.coordinator.sequences.owner and state.status == "finished"


def test_a_draining_coordinator_hands_its_sequences_over(pipeline, model_dirs, redis_url):
    """What SIGTERM does after AERIE_DRAIN_S (tests/services/test_chaos.py sends a real SIGTERM): the
    round in flight is committed and streamed, then the stream ends UNAVAILABLE naming the Resume
    index (also in the trailing metadata); the lease goes at once, another coordinator takes the
    sequence over and Resume there gives exactly the rest of the undisturbed run. The draining
    coordinator refuses new sequences."""
    import threading

    # a 30 s lease: a live stream is never taken over because a loaded machine delayed a renewal, and
    # the hand-over (not an expiry) is what lets the other coordinator claim it
    draining, address = pipeline.add_coordinator(redis_url, lease_ttl_s=30.0)
    req = GenerationRequest(PROMPT, 80, SamplingParams(0.8, 0.95, 0, 11), ignore_eos=True)
    expected = local_run(local_engine(model_dirs, draft_dtype="fp32"), req)[0]
    stub = coordinator_grpc.CoordinatorStub(pipeline.channel_to(address))
    call = stub.Generate(cpb.GenerateRequest(prompt_ids=list(PROMPT), max_new_tokens=80, ignore_eos=True,
                                             sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=11)),
                         timeout=60)
    got, seq_id = [], ""
    for msg in call:
        got += msg.tokens
        seq_id = seq_id or msg.sequence_id
        if len(got) >= 10:
            break
    from tests.coordinator.test_failover import failovers

    counted = failovers("coordinator", "drain"), failovers("coordinator", "takeover")
    handed = []
    drain = threading.Thread(target=lambda: handed.append(draining.sequences.hand_over_all(0.0, 30.0)))
    drain.start()
    with pytest.raises(grpc.RpcError) as e:
        for msg in call:
            got += msg.tokens
            assert not msg.finish_reason  # handed over long before its end
    drain.join(30)
    assert handed == [1]
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"from_token_index={len(got)}" in e.value.details() and "draining" in e.value.details()
    assert dict(e.value.trailing_metadata())["aerie-resume-from"] == str(len(got))
    state = pipeline.coordinator.store.get(seq_id)
    assert state.tokens[:len(got)] == got  # every committed token was streamed before the end ...
    assert len(state.tokens) == len(got) or state.owner != draining.sequences.owner  # ... none held back
    with pytest.raises(grpc.RpcError) as refused:  # no new sequences while draining
        list(stub.Generate(cpb.GenerateRequest(prompt_ids=list(PROMPT), max_new_tokens=4), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
    tokens, reason = resume(pipeline, seq_id, len(got))  # on the other coordinator
    assert got + tokens == expected and reason == "length"
    # taken over by a live coordinator other than the draining one (this module's pipeline runs more
    # than one: any of them may claim a handed-over sequence)
    live = {c.sequences.owner for _, c in pipeline.servers if isinstance(c, Coordinator) and c is not draining}
    assert pipeline.coordinator.store.get(seq_id).owner in live
    assert failovers("coordinator", "drain") == counted[0] + 1 and failovers("coordinator", "takeover") >= counted[1] + 1
