"""Continuous batching through the real services (gRPC on loopback, real Redis, tiny models): calls
that arrive while a forward runs share the next forward; a bad call in that batch fails alone with
its precise status; a full batch queue answers RESOURCE_EXHAUSTED naming the limit after its
deadline; concurrent sequences through the coordinator stream what each gets alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.engine.batcher import BatchLimits
from services.engine.engine import GenerationRequest
from services.rpc.config import ServiceConfig
from services.rpc.coordinator_client import RemoteSession
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.sampling import SamplingParams
from tests.pipeline import HOST, local_engine, local_run, start_pipeline, wait_until
from verifier_svc.config import VerifierConfig
from verifier_svc.server import create_server as create_verifier
from verifier_svc.server import load_servicer as load_verifier


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, max_sequences=12)
    yield p
    p.close()


def prefill(stub, seq_id: str, prompt: list[int]) -> int:
    req = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=prompt, capacity=len(prompt) + 20,
                                     sampling=pb.SamplingParams(), feature_kind=pb.FEATURE_KIND_NONE)
    return list(stub.Prefill(req, timeout=30))[0].first_token


def held(servicer):
    """Hold the servicer's model thread until the returned event is set."""
    gate = threading.Event()
    servicer.batcher.exclusive(gate.wait, 30)
    return gate


def test_calls_during_a_forward_share_the_next_one_and_bad_ones_fail_alone(pipeline):
    stub = verifier_grpc.VerifierStub(pipeline.channel("verifier"))
    prompts = [[5, 6, 7], [9, 1, 4, 4, 2], [3], [8, 8]]
    firsts = [prefill(stub, f"b{i}", p) for i, p in enumerate(prompts)]
    # the tokens each sequence decodes alone (a second copy of each, one call at a time)
    alone = [prefill(stub, f"solo{i}", p) for i, p in enumerate(prompts)]
    expected = [stub.Decode(vpb.DecodeRequest(sequence_id=f"solo{i}", round_index=1, token=firsts[i]),
                            timeout=30).token for i in range(len(prompts))]
    assert alone == firsts
    servicer = pipeline.verifier
    before = servicer.batcher.batches
    gate = held(servicer)
    calls = [vpb.DecodeRequest(sequence_id=f"b{i}", round_index=1, token=firsts[i]) for i in range(len(prompts))]
    calls.insert(2, vpb.DecodeRequest(sequence_id="nobody", round_index=1, token=1))
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(stub.Decode.future(c, timeout=30).result) for c in calls]
        wait_until(lambda: servicer.batcher.waiting == len(calls))
        gate.set()
        results = []
        for f in futures:
            try:
                results.append(f.result())
            except grpc.RpcError as e:
                results.append(e)
    bad = results.pop(2)
    assert bad.code() == grpc.StatusCode.NOT_FOUND and "unknown sequence 'nobody'" in bad.details()
    assert [r.token for r in results] == expected
    assert servicer.batcher.batches == before + 1  # ONE forward for all five calls
    assert servicer.batcher.largest_batch >= len(calls)
    for i in range(len(prompts)):
        for sid in (f"b{i}", f"solo{i}"):
            stub.Release(pb.ReleaseRequest(sequence_id=sid), timeout=30)


def test_full_batch_queue_is_resource_exhausted_after_its_deadline(pipeline, model_dirs):
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            batch=BatchLimits(max_batch=4, max_queue=2, queue_timeout_s=0.3))
    servicer = load_verifier(config)
    server, port = pipeline.loop.run(create_verifier(f"{HOST}:0", config, servicer))
    pipeline.servers.append((server, servicer))
    stub = verifier_grpc.VerifierStub(pipeline.channel_to(f"{HOST}:{port}"))
    first = prefill(stub, "q0", [1, 2, 3])
    gate = held(servicer)
    calls = [vpb.DecodeRequest(sequence_id="q0", round_index=1, token=first) for _ in range(2)] + \
            [vpb.DecodeRequest(sequence_id="q0", round_index=1, token=first) for _ in range(2)]
    with ThreadPoolExecutor(len(calls)) as pool:
        queued = [pool.submit(stub.Decode, c, timeout=30) for c in calls[:2]]
        wait_until(lambda: servicer.batcher.waiting == 2)
        refused = [pool.submit(stub.Decode, c, timeout=30) for c in calls[2:]]
        errors = []
        for f in refused:
            with pytest.raises(grpc.RpcError) as e:
                f.result()
            errors.append(e.value)
        gate.set()
        tokens = [f.result().token for f in queued]
    for e in errors:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "batch queue is full" in e.details() and "max_queue 2" in e.details()
    assert tokens[0] == tokens[1]  # the repeat of round 1 is a replay, in the next batch


def test_concurrent_sequences_through_the_coordinator_equal_batch1(pipeline, model_dirs):
    reference = local_engine(model_dirs)
    reqs = [GenerationRequest(tuple(range(3, 3 + n)), 12 + 5 * n, s)
            for n, s in zip(range(1, 9), [SamplingParams(), SamplingParams(0.8, 0.9, 0, 4)] * 4)]
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        s = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=120)
        results[i] = [t for step in s.engine.generate(reqs[i]) for t in step.tokens]
        s.close()

    pipeline.verifier.batcher.largest_batch = pipeline.drafter.batcher.largest_batch = 0
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, req in enumerate(reqs):
        assert results[i] == local_run(reference, req)[0], f"request {i}"
    assert pipeline.verifier.batcher.largest_batch >= 2
    assert pipeline.drafter.batcher.largest_batch >= 2
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and pipeline.drafter.drafter.num_sequences == 0)
