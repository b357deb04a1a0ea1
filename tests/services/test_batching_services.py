"""Continuous batching through the real services (gRPC on loopback, real Redis, tiny models): calls
that arrive while a forward runs share the next forward; a bad call in that batch fails alone with
its precise status; a full batch queue answers RESOURCE_EXHAUSTED naming the limit after its
deadline; concurrent sequences through the coordinator stream what each gets alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

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
    servicer.batcher.exclusive(gate.wait, 120)  # released by the test (120 s: a hang guard)
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
    # both model threads held until two sequences' calls queue at each: the batches of >= 2 asserted
    # below are made so, not left to how the threads happen to be scheduled
    verifier_gate, drafter_gate = held(pipeline.verifier), held(pipeline.drafter)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    wait_until(lambda: pipeline.verifier.batcher.waiting >= 2)
    verifier_gate.set()
    wait_until(lambda: pipeline.drafter.batcher.waiting >= 2)
    drafter_gate.set()
    for t in threads:
        t.join(180)
    for i, req in enumerate(reqs):
        assert results[i] == local_run(reference, req)[0], f"request {i}"
    assert pipeline.verifier.batcher.largest_batch >= 2
    assert pipeline.drafter.batcher.largest_batch >= 2
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and pipeline.drafter.drafter.num_sequences == 0)


def test_kv_budget_admission_waits_then_refuses_naming_the_budget(pipeline, model_dirs):
    """--kv-budget-mb: a Prefill whose KV does not fit waits for a release (bounded), then is
    refused with RESOURCE_EXHAUSTED naming the budget; a sequence larger than the whole budget is
    refused at once; nothing is partially admitted."""
    rows_budget = 100
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            kv_budget_mb=rows_budget * 512 / 2 ** 20, kv_wait_s=0.5)
    servicer = load_verifier(config)
    assert servicer.runner.pool.bytes_per_row == 512 and servicer.runner.pool.max_rows == rows_budget
    server, port = pipeline.loop.run(create_verifier(f"{HOST}:0", config, servicer))
    pipeline.servers.append((server, servicer))
    stub = verifier_grpc.VerifierStub(pipeline.channel_to(f"{HOST}:{port}"))

    def prefill_rows(seq_id: str, capacity: int):
        req = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=[1, 2, 3], capacity=capacity,
                                         sampling=pb.SamplingParams(), feature_kind=pb.FEATURE_KIND_NONE)
        return list(stub.Prefill(req, timeout=30))

    prefill_rows("a", 80)
    # does not fit while "a" holds 80 rows: waits, and is admitted when "a" is released
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(prefill_rows, "b", 60)
        wait_until(lambda: servicer._kv_waiting == 1)
        stub.Release(pb.ReleaseRequest(sequence_id="a"), timeout=10)
        assert waiting.result(10)[0].first_token >= 0
    # nothing is released now: refused after the wait, naming the budget
    with pytest.raises(grpc.RpcError) as e:
        prefill_rows("c", 60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV budget of 100 rows" in e.value.details() and "waited 0.5 s" in e.value.details()
    # larger than the whole budget: refused at once
    with pytest.raises(grpc.RpcError) as e:
        prefill_rows("d", 101)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV for 101 rows" in e.value.details()
    assert servicer.num_sequences == 1 and servicer.runner.pool.rows_allocated == 60


def test_kv_budget_defaults_to_a_share_of_free_memory():
    """Without --kv-budget-mb the budget is --kv-budget-share of the device's free memory (here the
    CPU's MemAvailable, or the cgroup's remaining limit), 0 means unbounded, and an explicit budget
    wins; a share outside [0, 1] is a configuration error naming it."""
    from services.device import free_memory_bytes
    from services.rpc.config import ConfigError
    from verifier_svc.servicer import kv_budget_rows

    bpr = 4096
    free = free_memory_bytes("cpu")
    rows = kv_budget_rows(VerifierConfig(ServiceConfig(host=HOST), kv_budget_share=0.25), bpr, "cpu")
    assert rows is not None and abs(rows * bpr - 0.25 * free) < 0.05 * free  # free memory moves a little
    assert kv_budget_rows(VerifierConfig(ServiceConfig(host=HOST), kv_budget_share=0), bpr, "cpu") is None
    assert kv_budget_rows(VerifierConfig(ServiceConfig(host=HOST), kv_budget_mb=1.0), bpr, "cpu") == 256
    with pytest.raises(ConfigError, match="kv_budget_share must be in"):
        VerifierConfig(ServiceConfig(host=HOST), kv_budget_share=1.5)


def test_chunked_prefill_equals_one_forward_and_lets_rounds_in_between(pipeline, model_dirs):
    """--prefill-chunk 4: an 11-token prompt is prefilled in 3 forwards (4 + 4 + 3 rows), each its
    own batcher call (another sequence's decode can run between them); the first token and the
    decoded tokens equal the unchunked verifier's."""
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32", prefill_chunk=4)
    servicer = load_verifier(config)
    server, port = pipeline.loop.run(create_verifier(f"{HOST}:0", config, servicer))
    pipeline.servers.append((server, servicer))
    chunked = verifier_grpc.VerifierStub(pipeline.channel_to(f"{HOST}:{port}"))
    whole = verifier_grpc.VerifierStub(pipeline.channel("verifier"))
    prompt = [7, 3, 99, 12, 5, 5, 61, 2, 9, 40, 17]

    def run(stub, seq_id: str) -> list[int]:
        req = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=prompt, capacity=40,
                                         sampling=pb.SamplingParams(), feature_kind=pb.FEATURE_KIND_HIDDEN)
        out = list(stub.Prefill(req, timeout=30))
        tokens = [out[0].first_token]
        for r in range(1, 4):
            tokens.append(stub.Decode(vpb.DecodeRequest(sequence_id=seq_id, round_index=r, token=tokens[-1]),
                                      timeout=30).token)
        stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=10)
        return tokens

    other = prefill(chunked, "other", [4, 4])
    before = servicer.batcher.batches
    gate = held(servicer)
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(run, chunked, "long")
        wait_until(lambda: servicer.batcher.waiting == 1)  # the first chunk waits at the gate
        gate.set()
        wait_until(lambda: servicer.batcher.batches >= before + 1)
        # a decode of another sequence joins between the chunks
        mid = chunked.Decode(vpb.DecodeRequest(sequence_id="other", round_index=1, token=other), timeout=30)
        tokens = long.result(60)
    assert tokens == run(whole, "long-whole")
    assert mid.token >= 0 and servicer.batcher.batches >= before + 3 + 3  # 3 chunks + 3 decodes (+ other's)


def test_the_step_budget_is_learned_and_auto_is_three_plain_steps(pipeline, model_dirs):
    """--itl-target-ms auto: the budget's target is 3 plain steps (before any ran, 3 x the start-up
    curve's one-row forward: 3 x 50 ms -> 101 rows on this curve); a number of ms is a fixed target;
    either way the batcher sizes the steps by the cost learned from them (services/engine/step_cost.py);
    0 is off."""
    from services.spec.cost import CostCurve
    from verifier_svc.servicer import VerifierServicer

    base = pipeline.verifier
    cost = CostCurve((1, 1000), (0.05, 1.049))
    made = {t: VerifierServicer(base.target, VerifierConfig(ServiceConfig(host=HOST), itl_target_ms=t),
                                base.target_path, base.eos_token_ids, cost) for t in ("auto", 200.0, 0.0)}
    try:
        auto, fixed, off = made["auto"], made[200.0], made[0.0]
        assert auto.step_rows == 101 and auto.step_budget.target_s is None
        assert auto.step_budget.target([]) == pytest.approx(0.15)
        assert fixed.step_rows == 151 and fixed.step_budget.target_s == 0.2
        assert auto.batcher.budget is auto.step_budget and fixed.batcher.budget is fixed.step_budget
        assert off.step_rows is None and off.step_budget is None and off.batcher.budget is None
    finally:
        for s in made.values():
            s.close()


def test_a_chunk_is_sliced_into_budget_steps_while_another_sequence_decodes(pipeline, model_dirs):
    """An 8-row step budget: while another sequence decodes here, each 28-row chunk of a 56-token
    prompt sent chunk by chunk (as a coordinator sends it: offset, more) runs as four forwards
    (8 + 8 + 8 + 4 rows: a slice's rest is sliced again) inside its one call; with
    no other sequence the same chunks run one forward each. The first token, the features and the
    decoded tokens equal the unchunked verifier's."""
    from services.rpc import codec
    from services.spec.cost import CostCurve
    from verifier_svc.servicer import VerifierServicer

    base = pipeline.verifier
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            prefill_chunk=28, itl_target_ms=1)
    servicer = VerifierServicer(base.target, config, base.target_path, base.eos_token_ids,
                                CostCurve((1, 1000), (0.05, 1.049)))
    assert servicer.step_rows == 16 and servicer.prefill_chunk == 28  # the budget's floor; the chunk as set
    servicer.batcher.step_rows = 8  # the tiny model's 64-token context is below that floor: an 8-row budget,
    servicer.batcher.budget = None  # fixed (not the one learned from the steps: services/engine/step_cost.py)
    server, port = pipeline.loop.run(create_verifier(f"{HOST}:0", config, servicer))
    pipeline.servers.append((server, servicer))
    sliced = verifier_grpc.VerifierStub(pipeline.channel_to(f"{HOST}:{port}"))
    whole = verifier_grpc.VerifierStub(pipeline.channel("verifier"))
    prompt = [(7 * i + 3) % 128 for i in range(56)]

    def run(stub, seq_id: str, chunk: int) -> tuple[list[int], torch.Tensor]:
        features = []
        for offset in range(0, len(prompt), chunk):
            part = prompt[offset:offset + chunk]
            req = vpb.VerifierPrefillRequest(
                sequence_id=seq_id, prompt_ids=part, capacity=64, sampling=pb.SamplingParams(),
                feature_kind=pb.FEATURE_KIND_HIDDEN, offset=offset, more=offset + len(part) < len(prompt),
                prompt_tokens=len(prompt))
            out = list(stub.Prefill(req, timeout=60))
            joined = codec.TensorAssembler("features")
            for m in out:
                joined.add(m.features)
            features.append(joined.result())
        tokens = [out[0].first_token]
        for r in range(1, 4):
            tokens.append(stub.Decode(vpb.DecodeRequest(sequence_id=seq_id, round_index=r, token=tokens[-1]),
                                      timeout=30).token)
        stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=10)
        return tokens, torch.cat(features)

    before = servicer.batcher.batches
    alone = run(sliced, "alone", 28)
    assert servicer.batcher.batches - before == 2 + 3  # whole chunks: 2 forwards, then 3 decodes
    other = prefill(sliced, "other", [4, 4])  # holds KV here and decodes next: the budget applies
    before = servicer.batcher.batches
    beside = run(sliced, "beside", 28)
    assert servicer.batcher.batches - before == 8 + 3  # 8 + 8 + 8 + 4 rows per chunk, then 3 decodes
    assert other >= 0
    expected = run(whole, "whole", 56)
    for tokens, features in (alone, beside):
        assert tokens == expected[0]
        torch.testing.assert_close(features, expected[1], rtol=1e-4, atol=1e-4)


def test_an_adaptive_sequence_detaches_its_drafter_through_the_services(pipeline, model_dirs, redis_url):
    """An auto-budget drafter whose head costs more than it can win even when every draft is
    accepted (this tiny head's are, at depth 1): the coordinator's budget picks plain steps, so the
    sequence's rounds are Decode calls that keep their features on the verifier and the drafter sees
    a draft call only at each probe (after 16 plain rounds, then 32: backing off); the tokens are plain
    decoding's (greedy) and replay (seeded), and aerie_detached_rounds_total counts the rounds."""
    from prometheus_client import REGISTRY

    from drafter_svc.config import DrafterConfig
    from drafter_svc.server import create_server as create_drafter
    from drafter_svc.server import load_servicer as load_drafter
    from services.spec.cost import CostCurve

    config = DrafterConfig(pipeline.service, draft=str(model_dirs.head), target=str(model_dirs.target), dtype="fp32",
                           tree=None, max_sequences=4)
    drafter = load_drafter(config)
    # a draft of ~0.5 s against a 0.2 s forward: 2 tokens per 0.7 s never beat plain's 1 per 0.2 s
    # (a lone sequence probes anyway); model times far above the tiny models' real ones, so the
    # measured extras stay 0
    drafter.costs = (CostCurve((1, 16), (0.25, 0.3)), CostCurve((1, 16), (0.25, 0.3)))
    drafts = []
    inner = drafter.drafter.draft_many
    drafter.drafter.draft_many = lambda calls: (drafts.extend(calls), inner(calls))[1]
    server, port = pipeline.loop.run(create_drafter(f"{HOST}:0", config, drafter))
    pipeline.servers.append((server, drafter))
    saved = pipeline.verifier.verify_cost
    pipeline.verifier.verify_cost = CostCurve((1, 2, 4, 8, 16, 32, 64), (0.2, 0.204, 0.208, 0.22, 0.24, 0.28, 0.36))
    try:
        _, address = pipeline.add_coordinator(redis_url, drafters=(f"{HOST}:{port}",))
        plain = local_engine(model_dirs, with_drafter=False)
        count = lambda: REGISTRY.get_sample_value("aerie_detached_rounds_total", {"service": "coordinator"}) or 0.0
        for sampling in (SamplingParams(), SamplingParams(0.8, 0.9, 0, 4)):
            req = GenerationRequest((5, 17, 99, 3, 42, 8), 40, sampling, ignore_eos=True)
            before, drafts[:] = count(), []
            runs = []
            for _ in range(2):
                s = RemoteSession(address, None, "", timeout_s=120)
                runs.append([t for step in s.engine.generate(req) for t in step.tokens])
                s.close()
            assert runs[0] == runs[1]  # a seed replays
            if sampling.greedy:
                assert runs[0] == local_run(plain, req)[0]
            detached = count() - before
            assert detached >= 2 * 30, detached  # 39 rounds each: all plain steps but 2 per probe
            assert 2 <= len(drafts) <= 2 * 3, len(drafts)  # a draft call per probe only
            # each probe's draft brings every row since the last one: the prompt and the rounds between
            assert sum(int(c.tokens.shape[0]) for c in drafts) <= 2 * (6 + 40)
    finally:
        pipeline.verifier.verify_cost = saved
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and drafter.drafter.num_sequences == 0)
