"""The sliding-window context cap: sliding-window attention is not implemented, so a Mistral model
with `sliding_window` serves contexts up to the window (where full attention is exact) and refuses
longer requests with the limit in the message; Qwen2's window applies only with use_sliding_window."""

import pytest

from services.engine.engine import GenerationRequest
from services.engine.local import build_local_engine
from services.errors import InvalidRequest
from tests.helpers import hf_greedy, tiny_hf

WINDOW = 48
PROMPT = [5, 17, 99, 3, 42, 8, 1, 60, 31, 2]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    hf = tiny_hf("mistral", seed=4, sliding_window=WINDOW)
    path = tmp_path_factory.mktemp("mistral-sw")
    hf.save_pretrained(path)
    return hf, build_local_engine(str(path), "none", "fp32").engine


def test_context_is_capped_to_the_window(mistral):
    hf, engine = mistral
    assert engine.max_context == WINDOW  # not max_position_embeddings (512)
    full = GenerationRequest(tuple(PROMPT), WINDOW - len(PROMPT))
    tokens = [t for s in engine.generate(full) for t in s.tokens]
    assert tokens == hf_greedy(hf, PROMPT, WINDOW - len(PROMPT))  # exact up to the window
    with pytest.raises(InvalidRequest, match=f"= {WINDOW + 1} exceeds the model context of {WINDOW} tokens"):
        list(engine.generate(GenerationRequest(tuple(PROMPT), WINDOW - len(PROMPT) + 1)))


@pytest.mark.parametrize("arch,overrides,expected", [
    ("mistral", {"sliding_window": None}, 512),
    ("qwen2", {"sliding_window": WINDOW, "use_sliding_window": False}, 512),
    ("qwen2", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 0}, WINDOW),
    ("qwen2", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2}, 512),  # no layer slides
])
def test_which_configs_are_capped(tmp_path, arch, overrides, expected):
    tiny_hf(arch, **overrides).save_pretrained(tmp_path)
    assert build_local_engine(str(tmp_path), "none", "fp32").engine.max_context == expected
