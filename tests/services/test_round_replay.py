"""A retried Verify / Draft / Decode (same sequence, same round index: the coordinator retries after a
lost response) gets the same answer and advances no KV twice: every call below is sent twice, the
answers must be byte-identical, and the output must still equal the in-process engine's."""

import pytest

from services.engine.engine import Engine, GenerationRequest
from services.rpc.clients import DrafterClient, VerifierClient
from services.spec.sampling import SamplingParams
from tests.pipeline import local_engine, local_run, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    yield p
    p.close()


def send_twice(client, methods: tuple[str, ...], replays: list[str]) -> None:
    """Every call of `methods` is made twice; the first answer is dropped as if lost on the way."""
    call = client.call

    def retried(method, request, timeout_s=None):
        first = call(method, request, timeout_s)
        name = next((m for m in methods if method is getattr(client.stub, m)), None)
        if name is None:
            return first
        again = call(method, request, timeout_s)
        assert again.SerializeToString(deterministic=True) == first.SerializeToString(deterministic=True), name
        replays.append(name)
        return again

    client.call = retried


def engine_over_grpc(pipeline, with_drafter: bool, replays: list[str]) -> Engine:
    vclient = VerifierClient(pipeline.addresses["verifier"], pipeline.service.max_message_bytes, 30)
    send_twice(vclient, ("Verify", "Decode"), replays)
    drafter = None
    if with_drafter:
        dclient = DrafterClient(pipeline.addresses["drafter"], pipeline.service.max_message_bytes, 30)
        send_twice(dclient, ("Draft",), replays)
        drafter = dclient.for_sequence()
    info = vclient.info()
    verifier = vclient.for_sequence(drafter.feature_kind if drafter else "none")
    return Engine(verifier, drafter, int(info.max_context), int(info.vocab_size),
                  tuple(int(t) for t in info.eos_token_ids))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.9, 0.95, 0, 7)], ids=["greedy", "sampled"])
def test_retried_verify_and_draft_replay(pipeline, model_dirs, sampling):
    replays: list[str] = []
    engine = engine_over_grpc(pipeline, True, replays)
    req = GenerationRequest(PROMPT, 40, sampling)
    assert local_run(engine, req) == local_run(local_engine(model_dirs), req)
    assert replays.count("Verify") >= 5 and replays.count("Draft") >= 4  # rounds 2.. draft; round 1 is Prefill
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and pipeline.drafter.drafter.num_sequences == 0)


def test_retried_decode_replays(pipeline, model_dirs):
    replays: list[str] = []
    engine = engine_over_grpc(pipeline, False, replays)
    req = GenerationRequest(PROMPT, 20, SamplingParams(0.8, 1.0, 0, 3))
    assert local_run(engine, req) == local_run(local_engine(model_dirs, with_drafter=False), req)
    assert replays.count("Decode") == 19
    wait_until(lambda: pipeline.verifier.num_sequences == 0)
