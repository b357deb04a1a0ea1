"""Session fixtures: tiny targets and distilled EAGLE heads (builders in tests/helpers.py)."""

import os
import tempfile

import pytest
import torch

from tests.helpers import distill_head, tiny_hf, to_native

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# cost-model calibrations of the tiny test models stay out of the user's ~/.cache/aerie/costs
os.environ.setdefault("AERIE_COST_DIR", os.path.join(tempfile.mkdtemp(prefix="aerie-costs-")))
# a Hub-id-shaped name that is not on disk is never downloaded in a test (services/model/hub.py)
os.environ.setdefault("AERIE_OFFLINE", "1")
torch.set_num_threads(1)


# docs/testing.md: whole directories out of the quick subset (`pytest -m "not slow"`): they start
# services (gRPC servers, Redis, `aerie up` processes), clients in other languages, the Helm chart, or
# train heads; single slow tests elsewhere carry @pytest.mark.slow themselves
SLOW_DIRS = ("bench", "clients", "coordinator", "dist", "gateway", "k8s", "security", "services", "train")
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """slow: every test under SLOW_DIRS; k8s: every test under tests/k8s; gpu tests skipped (with the
    reason) where torch sees no CUDA GPU."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        parts = os.path.relpath(str(item.path), TESTS).split(os.sep)
        if parts[0] in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)
        if parts[0] == "k8s":
            item.add_marker(pytest.mark.k8s)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def llama_pair():
    """(hf model, native target, trained EAGLE-2 head) for a 2-layer GQA Llama."""
    hf = tiny_hf("llama", layers=2, seed=0)
    target = to_native(hf)
    return hf, target, distill_head(target, "eagle", seed=0)


@pytest.fixture(scope="session")
def eagle3_pair():
    """(hf model, native target, trained EAGLE-3 head with a 96-token draft vocabulary) for an
    8-layer Llama (EAGLE-3 needs >= 7 layers for three distinct taps)."""
    hf = tiny_hf("llama", layers=8, seed=1)
    target = to_native(hf)
    return hf, target, distill_head(target, "eagle3", seed=1, draft_vocab=96)
