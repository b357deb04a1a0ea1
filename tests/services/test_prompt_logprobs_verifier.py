"""The verifier service's Prefill with sampling.prompt_logprobs, over gRPC on loopback: however the
service cuts the prompt (its own --prefill-chunk for a whole-prompt call; a step budget that slices
each chunk while another sequence decodes), the first message's prompt_logprobs are the in-process
verifier's whole-prompt ones (tests/engine/test_prompt_logprobs.py checks those against transformers)."""

from __future__ import annotations

import pytest
import torch

from services.engine.verifier import Verifier
from services.rpc import codec
from services.rpc.config import ServiceConfig
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.rpc.stubs import verifier_grpc
from services.spec.sampling import SamplingParams
from tests.pipeline import HOST, start_pipeline
from verifier_svc.config import VerifierConfig
from verifier_svc.server import create_server as create_verifier

PROMPT = [(7 * i + 3) % 128 for i in range(40)]
K = 3


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, with_drafter=False)
    yield p
    p.close()


def expected(llama_pair):
    _, target, head = llama_pair
    v = Verifier(target, head.feature_kind)
    return v.prefill("ref", torch.tensor(PROMPT), SamplingParams(0.0, prompt_logprobs=K), 64).prompt_logprobs


def call(stub, seq_id: str, chunk: int):
    """Prefill PROMPT in `chunk`-row calls (a coordinator's offset / more) -> the concatenated prompt
    log-probabilities of the calls' first messages."""
    parts = []
    for offset in range(0, len(PROMPT), chunk):
        part = PROMPT[offset:offset + chunk]
        req = vpb.VerifierPrefillRequest(
            sequence_id=seq_id, prompt_ids=part, capacity=64, sampling=pb.SamplingParams(prompt_logprobs=K),
            feature_kind=pb.FEATURE_KIND_HIDDEN, offset=offset, more=offset + len(part) < len(PROMPT),
            prompt_tokens=len(PROMPT))
        out = list(stub.Prefill(req, timeout=60))
        assert out[0].HasField("prompt_logprobs") and not any(m.HasField("prompt_logprobs") for m in out[1:])
        parts.append(codec.decode_logprobs(out[0].prompt_logprobs, None))
    stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=10)
    return type(parts[0]).cat(parts)


def same(got, want) -> None:
    assert got.token_ids.tolist() == PROMPT[1:] == want.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-4)
    assert torch.equal(got.top_ids, want.top_ids) and torch.equal(got.ranks, want.ranks)


def test_the_services_own_chunks(pipeline, model_dirs, llama_pair):
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32", prefill_chunk=6)
    base = pipeline.verifier
    from verifier_svc.servicer import VerifierServicer

    servicer = VerifierServicer(base.target, config, base.target_path, base.eos_token_ids)
    server, port = pipeline.loop.run(create_verifier(f"{HOST}:0", config, servicer))
    pipeline.servers.append((server, servicer))
    stub = verifier_grpc.VerifierStub(pipeline.channel_to(f"{HOST}:{port}"))
    want = expected(llama_pair)
    same(call(stub, "whole", len(PROMPT)), want)  # one call, 7 forwards of 6 rows (the service's chunks)
    same(call(stub, "chunked", 16), want)  # the caller's chunks, each cut in the service's


def test_slices_of_a_step_budget(pipeline, model_dirs, llama_pair):
    from services.spec.cost import CostCurve
    from verifier_svc.servicer import VerifierServicer

    base = pipeline.verifier
    config = VerifierConfig(ServiceConfig(host=HOST), target=str(model_dirs.target), dtype="fp32",
                            prefill_chunk=20, itl_target_ms=1)
    servicer = VerifierServicer(base.target, config, base.target_path, base.eos_token_ids,
                                CostCurve((1, 1000), (0.05, 1.049)))
    servicer.batcher.step_rows = 8  # (as tests/services/test_batching_services.py: an 8-row budget,
    servicer.batcher.budget = None  # fixed, not the one learned from the steps)
    server, port = pipeline.loop.run(create_verifier(f"{HOST}:0", config, servicer))
    pipeline.servers.append((server, servicer))
    stub = verifier_grpc.VerifierStub(pipeline.channel_to(f"{HOST}:{port}"))
    other = vpb.VerifierPrefillRequest(sequence_id="other", prompt_ids=[4, 4], capacity=16,
                                       sampling=pb.SamplingParams(), feature_kind=pb.FEATURE_KIND_HIDDEN)
    list(stub.Prefill(other, timeout=60))  # holds KV here: the budget slices the next prompt's chunks
    before = servicer.batcher.batches
    same(call(stub, "sliced", 20), expected(llama_pair))
    assert servicer.batcher.batches - before == 6  # 8 + 8 + 4 rows per 20-row chunk: sliced indeed


def test_a_rebuild_does_not_score_the_prompt(pipeline):
    """A fail-over's rebuild (prompt + committed tokens) was scored by the first prefill: its answer has none."""
    stub = verifier_grpc.VerifierStub(pipeline.channel("verifier"))
    req = vpb.VerifierPrefillRequest(sequence_id="rebuilt", prompt_ids=PROMPT[:10], capacity=32, rebuild=True,
                                     sampling=pb.SamplingParams(prompt_logprobs=K), feature_kind=pb.FEATURE_KIND_HIDDEN)
    out = list(stub.Prefill(req, timeout=60))
    stub.Release(pb.ReleaseRequest(sequence_id="rebuilt"), timeout=10)
    assert out[0].first_token >= 0 and not any(m.HasField("prompt_logprobs") for m in out)
