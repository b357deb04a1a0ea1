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
