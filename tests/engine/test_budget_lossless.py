"""Lossless whatever the budget picks: greedy output == transformers, token for token, in fp32, with
the auto budget changing the shape round by round (plain rounds included), with retrieval alone
(`--draft sam`) and with retrieval chains merged into EAGLE trees (`eagle+sam`)."""

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.acceptance import prior_stats
from services.spec.budget import AUTO_LARGEST, Budget
from services.spec.cost import CostCurve, CostModel
from services.spec.sampling import SamplingParams
from tests.helpers import VOCAB, hf_greedy

ROWS = (1, 2, 4, 8, 16, 32, 64)


def costs(per_row: float) -> CostModel:
    """Synthetic: verify 1 + per_row * (rows - 1); a cheap head."""
    return CostModel(CostCurve(ROWS, tuple(1 + per_row * (r - 1) for r in ROWS)),
                     CostCurve((1, 16), (0.02, 0.05)), CostCurve((1, 16), (0.03, 0.2)))


def run(engine, prompt, n, **kw):
    tokens, rounds = [], []
    for step in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += step.tokens
        if step.stats.round_index > 0:
            rounds.append(step.stats)
    return tokens, rounds


def prompts(seed, count=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        part = torch.randint(0, VOCAB, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(part + part[:3] + part)  # repeats: something for retrieval to find
    return out


@pytest.mark.parametrize("per_row", [0.02, 0.3])
def test_auto_budget_is_lossless_and_changes_shape(llama_pair, per_row):
    hf, target, head = llama_pair
    budget = Budget(costs(per_row), prior_stats({"top1_agreement": 0.3}), largest=AUTO_LARGEST, probe_every=3)
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, AUTO_LARGEST), 512, VOCAB,
                    budget=budget)
    sizes = set()
    for prompt in prompts(seed=3):
        tokens, rounds = run(engine, prompt, 40)
        assert tokens == hf_greedy(hf, prompt, 40), f"prompt {prompt}"
        sizes |= {r.tree_size for r in rounds}
    assert len(sizes) >= 2, f"the budget never changed the tree: sizes {sizes}"
    if per_row == 0.3:
        assert 0 in sizes, "expensive verification must lead to plain rounds"


def test_sam_alone_is_lossless_and_accepts_chains(llama_pair):
    hf, target, _ = llama_pair
    engine = Engine(Verifier(target, "none"), None, 512, VOCAB,
                    budget=Budget(costs(0.02), eagle=False, chain_limit=8), retrieval=True)
    accepted = 0
    for prompt in prompts(seed=4):
        tokens, rounds = run(engine, prompt, 48)
        assert tokens == hf_greedy(hf, prompt, 48), f"prompt {prompt}"
        accepted += sum(r.accept_length - 1 for r in rounds)
        assert all(r.tree_max_depth <= 8 for r in rounds)
    assert accepted > 0, "retrieval never proposed an accepted token"


@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_eagle_plus_sam_is_lossless(pair, request):
    hf, target, head = request.getfixturevalue(pair)
    budget = Budget(costs(0.02), prior_stats({"top1_agreement": 0.5}), chain_limit=8)
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, AUTO_LARGEST), 512, VOCAB,
                    budget=budget, retrieval=True)
    chained = 0
    for prompt in prompts(seed=5):
        tokens, rounds = run(engine, prompt, 48)
        assert tokens == hf_greedy(hf, prompt, 48), f"prompt {prompt}"
        chained += sum(r.chain > 0 for r in rounds)
    assert chained > 0, "no round carried a retrieved chain"


def test_sampling_with_auto_budget_replays_and_stays_in_vocabulary(llama_pair):
    """The exactness of sampling with merged chains is the chi-square in tests/spec/test_sam.py; here
    the whole loop runs: same seed, same tokens (budget decisions are deterministic)."""
    _, target, head = llama_pair
    budget = Budget(costs(0.05), chain_limit=8)
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, AUTO_LARGEST), 512, VOCAB,
                    budget=budget, retrieval=True)
    prompt = prompts(seed=6, count=1)[0]
    a, _ = run(engine, prompt, 32, sampling=SamplingParams(0.8, top_p=0.9, seed=11))
    b, _ = run(engine, prompt, 32, sampling=SamplingParams(0.8, top_p=0.9, seed=11))
    assert a == b and len(a) == 32 and all(0 <= t < VOCAB for t in a)
