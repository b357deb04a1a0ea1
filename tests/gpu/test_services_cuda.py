"""The services on CUDA (`pytest -m gpu`; skipped without a GPU, and without the services' packages:
scripts/gpu_check.sh installs them from .whl/, which scripts/gpu_wheels.sh fills): the verifier and
drafter services of `aerie up` on the GPU (their default device there), through real gRPC servers on
loopback and a real Redis, fp32: plain runs whose greedy steps are queued on the device before the
previous token is read (QueuedToken) stream transformers' greedy tokens; EAGLE rounds with several
sequences at once (the drafter service's batches, DraftGraphs.draft_batch where two share a shape)
give each sequence transformers' greedy tokens (both passed on an H200, 2026-11-27); a verifier that
drafts too (verifier --draft, on its CUDA device) drafting each next tree inside the Verify for
several sequences at once gives the same (written without a GPU: not run on one yet); so does a
verifier that sends each verdict's Draft to the drafter process itself (--direct-drafts; written
without a GPU too), and one that drafts the next tree ahead at the drafter inside runs (--overlap
always; written without a GPU, its body run on the CPU before it was committed)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on one)")]

WHEELS = "the services' packages are missing: bash scripts/gpu_wheels.sh here, carry .whl/ (scripts/gpu_check.sh)"
pytest.importorskip("grpc", reason=WHEELS)
pytest.importorskip("redis", reason=WHEELS)
pytest.importorskip("opentelemetry.sdk", reason=WHEELS)

from services.engine.engine import GenerationRequest  # noqa: E402
from tests.helpers import hf_greedy  # noqa: E402
from tests.pipeline import (  # noqa: E402, F401 (fixtures)
    count_queued_answers,
    model_dirs,
    redis_url,
    remote_run,
    run_concurrently,
    start_pipeline,
)

PROMPT = (5, 17, 99, 3, 42, 8)


def test_plain_runs_through_the_services_queue_steps_on_cuda(model_dirs, redis_url, llama_pair, monkeypatch):
    made = count_queued_answers(monkeypatch)
    p = start_pipeline(model_dirs, redis_url, with_drafter=False, discover=False, verifier_overrides={"device": "cuda"})
    try:
        assert p.verifier.target.device.type == "cuda" and p.verifier.queue_runs
        tokens, reason, accepts = remote_run(p, GenerationRequest(PROMPT, 40, ignore_eos=True))
        assert tokens == hf_greedy(llama_pair[0], list(PROMPT), 40) and reason == "length"
        assert accepts == [1] * 39 and len(made) == 39  # every plain round a queued run step
    finally:
        p.close()


def test_eagle_rounds_of_several_sequences_through_the_services_on_cuda(model_dirs, redis_url, llama_pair):
    p = start_pipeline(model_dirs, redis_url, verifier_overrides={"device": "cuda"})
    try:
        assert p.verifier.target.device.type == "cuda" and p.drafter.drafter.graphs is not None
        prompts = [PROMPT, (9, 4, 77, 31), (3, 1, 4, 1, 5), (2, 71, 14, 9, 30)]
        got = run_concurrently(p, [GenerationRequest(prompt, 32, ignore_eos=True) for prompt in prompts])
        for i, prompt in enumerate(prompts):
            assert got[i] == hf_greedy(llama_pair[0], list(prompt), 32), i
        assert p.drafter.drafter.graphs.expansions > 0  # the static draft (graphs) served the drafts
    finally:
        p.close()


def test_a_verifier_that_drafts_too_on_cuda(model_dirs, redis_url, llama_pair):
    p = start_pipeline(model_dirs, redis_url, colocate=True, verifier_overrides={"device": "cuda"})
    try:
        head = p.verifier.drafter_servicer.drafter
        assert p.verifier.target.device.type == "cuda" and head.device.type == "cuda"
        prompts = [PROMPT, (9, 4, 77, 31), (3, 1, 4, 1, 5)]
        got = run_concurrently(p, [GenerationRequest(prompt, 32, ignore_eos=True) for prompt in prompts])
        for i, prompt in enumerate(prompts):
            assert got[i] == hf_greedy(llama_pair[0], list(prompt), 32), i
    finally:
        p.close()


def test_device_rounds_of_a_verifier_that_drafts_too_on_cuda(model_dirs, redis_url, llama_pair):
    """Its runs keep their tree rounds on the GPU (verifier_svc/device_round.py): one sequence at a time
    (each in runs of tree rounds), transformers' greedy tokens in fp32, the next trees queued from the
    verdicts and kept (none dropped)."""
    from prometheus_client import REGISTRY

    def rounds(outcome: str) -> float:
        return REGISTRY.get_sample_value("aerie_device_rounds_total", {"service": "verifier", "outcome": outcome}) or 0.0

    p = start_pipeline(model_dirs, redis_url, colocate=True, verifier_overrides={"device": "cuda"})
    try:
        assert p.verifier.device_rounds is not None
        kept, dropped = rounds("kept"), rounds("dropped")
        for prompt in (PROMPT, (9, 4, 77, 31)):
            assert remote_run(p, GenerationRequest(prompt, 40, ignore_eos=True))[0] == hf_greedy(
                llama_pair[0], list(prompt), 40)
        assert rounds("kept") - kept >= 8 and rounds("dropped") == dropped
    finally:
        p.close()


def test_direct_drafts_on_cuda(model_dirs, redis_url, llama_pair):
    from prometheus_client import REGISTRY

    def drafted() -> float:
        return REGISTRY.get_sample_value("aerie_direct_drafts_total", {"service": "verifier", "outcome": "drafted"}) or 0.0

    p = start_pipeline(model_dirs, redis_url, direct_drafts=True, verifier_overrides={"device": "cuda"})
    try:
        assert p.verifier.target.device.type == "cuda" and p.drafter.drafter.head.device.type == "cuda"
        before = drafted()
        prompts = [PROMPT, (9, 4, 77, 31), (3, 1, 4, 1, 5)]
        got = run_concurrently(p, [GenerationRequest(prompt, 32, ignore_eos=True) for prompt in prompts])
        for i, prompt in enumerate(prompts):
            assert got[i] == hf_greedy(llama_pair[0], list(prompt), 32), i
        assert drafted() > before  # the verifier sent the drafts
    finally:
        p.close()


def ahead_counter() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("aerie_direct_drafts_total", {"service": "verifier", "outcome": "ahead"}) or 0.0


def check_drafting_ahead_inside_runs(p, hf) -> None:
    """One sequence at a time (the policy weighs the others on its drafter): transformers' greedy tokens,
    rounds drafted ahead at the verifier, and DraftAhead hits the verifier counted."""
    before = ahead_counter()
    for prompt in (PROMPT, (9, 4, 77, 31)):
        tokens, reason, _ = remote_run(p, GenerationRequest(prompt, 32, ignore_eos=True))
        assert tokens == hf_greedy(hf, list(prompt), 32) and reason == "length", prompt
    assert ahead_counter() > before  # the verifier's DraftAheads hit


def test_drafting_ahead_inside_runs_on_cuda(model_dirs, redis_url, llama_pair):
    """--direct-drafts with --overlap always (verifier_svc/ahead_run.py): the verifier sends each round's
    DraftAhead to the drafter process beside its verify on the GPU, and takes the ahead tree on a hit."""
    p = start_pipeline(model_dirs, redis_url, direct_drafts=True, overlap="always",
                       verifier_overrides={"device": "cuda"})
    try:
        assert p.verifier.target.device.type == "cuda" and p.drafter.drafter.head.device.type == "cuda"
        check_drafting_ahead_inside_runs(p, llama_pair[0])
    finally:
        p.close()
