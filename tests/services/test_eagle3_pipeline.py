"""An EAGLE-3 head (three feature taps, a reduced draft vocabulary) served over gRPC: the pipeline
streams exactly what the in-process engine produces, greedy and sampled, and the taps really travel."""

import pytest

from services.engine.engine import GenerationRequest
from services.model.head_checkpoint import save_head
from services.rpc.coordinator_client import RemoteSession
from services.spec.sampling import SamplingParams
from tests.pipeline import ModelDirs, local_engine, local_run, start_pipeline, wait_until

PROMPT = (7, 3, 99, 12, 40)


@pytest.fixture(scope="module")
def eagle3_dirs(eagle3_pair, tmp_path_factory):
    hf, _, head = eagle3_pair
    root = tmp_path_factory.mktemp("eagle3-models")
    hf.save_pretrained(root / "target")
    save_head(head, root / "head")
    return ModelDirs(root / "target", root / "head")


@pytest.fixture(scope="module")
def pipeline(eagle3_dirs, redis_url):
    p = start_pipeline(eagle3_dirs, redis_url)
    yield p
    p.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.8, 0.95, 0, 4)], ids=["greedy", "sampled"])
def test_eagle3_stream_equals_in_process_engine(pipeline, eagle3_dirs, sampling):
    assert pipeline.drafter.drafter.head.feature_kind == "taps"
    req = GenerationRequest(PROMPT, 32, sampling)
    session = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=120)
    steps = list(session.engine.generate(req))
    session.close()
    tokens = [t for s in steps for t in s.tokens]
    accepts = [s.stats.accept_length for s in steps[1:]]
    reference = local_engine(eagle3_dirs)
    assert reference.drafter.head.feature_kind == "taps"
    assert (tokens, steps[-1].finish_reason, accepts) == local_run(reference, req)
    if sampling.greedy:
        assert max(accepts) > 1  # the head really drafts through the taps it is sent
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and pipeline.drafter.drafter.num_sequences == 0)
