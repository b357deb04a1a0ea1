"""Reduced draft vocabularies (FR-Spec), draft precisions and the int8 target keep output lossless.

Greedy: speculative output == transformers generate(do_sample=False) in fp32 for every K and draft
precision, on both head kinds. Sampling: a chi-square test of the first two emitted tokens against
the target's exact distribution with a reduced-vocabulary draft (and the same test rejects a wrong
law). int8 target: speculative output == aerie's own int8 plain decoding."""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.model.quant import QuantLinear, quantize_linears
from services.spec.sampling import SamplingParams, target_probs
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, hf_greedy

TREE = TreeParams(4, 3, 12)


def counts_for(hf, seed: int = 3) -> torch.Tensor:
    """Token counts from the target's own greedy text (any counts keep output lossless)."""
    g = torch.Generator().manual_seed(seed)
    toks = []
    for _ in range(4):
        toks += hf_greedy(hf, torch.randint(0, VOCAB, (6,), generator=g).tolist(), 24)
    return torch.bincount(torch.tensor(toks), minlength=VOCAB)


def tokens_of(engine: Engine, prompt: list[int], n: int, **kw) -> list[int]:
    return [t for step in engine.generate(GenerationRequest(tuple(prompt), n, **kw)) for t in step.tokens]


PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1, 64, 120, 33, 2, 9], [88, 4, 51]]


@pytest.mark.parametrize("draft_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("k", [0, 64, 8])
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_greedy_lossless_at_every_k_and_precision(pair, k, draft_dtype, request):
    hf, target, head = request.getfixturevalue(pair)
    head = copy.deepcopy(head)
    counts = counts_for(hf)
    full = head.draft_vocab_size
    if k:
        head.restrict_vocab(counts, k)
        assert head.draft_vocab_size == min(k, full)
    head.set_draft_dtype(draft_dtype)
    if draft_dtype == "int8":
        proj = head.vocab_proj if head.vocab_proj is not None else head.lm_head
        assert isinstance(proj, QuantLinear)
    drafter = Drafter(head, TREE)
    engine = Engine(Verifier(target, head.feature_kind), drafter, 512, VOCAB)
    for prompt in PROMPTS:
        assert tokens_of(engine, prompt, 32) == hf_greedy(hf, prompt, 32), (prompt, k, draft_dtype)
    if k and k < full:  # every drafted token is one of the K most frequent (of the head's own vocabulary)
        allowed = set(head.to_target(torch.arange(head.draft_vocab_size)).tolist())
        base_rank = torch.sort(-counts, stable=True).indices.tolist()
        drafter.start("probe", 64, sampling=False)
        tree = drafter.draft("probe", torch.tensor(PROMPTS[0][1:] + [1]),
                             _features(target, head, PROMPTS[0]))
        assert set(tree.tokens[1:].tolist()) <= allowed
        if pair == "llama_pair":
            assert allowed == set(base_rank[:k])


def _features(target, head, prompt):
    cache = target.new_cache(64)
    out = target(torch.tensor(prompt), cache, want_taps=head.feature_kind == "taps")
    return out.taps if head.feature_kind == "taps" else out.hidden


def test_restricted_vocab_keeps_the_d2t_convention(llama_pair, eagle3_pair):
    hf, _, head2 = llama_pair
    counts = torch.arange(VOCAB).flip(0)  # token 0 most frequent: K = 10 -> ids 0..9
    h = copy.deepcopy(head2)
    h.restrict_vocab(counts, 10)
    assert h.to_target(torch.arange(10)).tolist() == list(range(10))
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[[100, 3, 50]] = torch.tensor([9, 8, 7])
    h = copy.deepcopy(head2)
    h.restrict_vocab(counts, 3)
    assert h.to_target(torch.arange(3)).tolist() == [3, 50, 100]  # ascending target ids
    torch.testing.assert_close(h.vocab_proj.weight, head2._target_head[0].weight[[3, 50, 100]])
    # EAGLE-3: K restricts within the head's own 96-token vocabulary
    _, _, head3 = eagle3_pair
    h3 = copy.deepcopy(head3)
    own = set(head3.to_target(torch.arange(96)).tolist())
    outside = next(i for i in range(VOCAB) if i not in own)
    counts = torch.ones(VOCAB, dtype=torch.long)
    counts[outside] = 1000  # the most frequent token is one the head cannot draft
    h3.restrict_vocab(counts, 5)
    kept = h3.to_target(torch.arange(5)).tolist()
    assert outside not in kept and set(kept) <= own and kept == sorted(kept)
    assert "vocab_proj.weight" not in h3.state_dict()  # derived at load, never saved


@pytest.mark.slow  # docs/testing.md: out of the quick subset (> 4 s)
def test_sampling_with_reduced_vocab_preserves_the_target_law(llama_pair):
    """Chi-square over the first two emitted tokens at temperature 1 with a K=8 draft."""
    _, target, head = llama_pair
    head = copy.deepcopy(head)
    head.restrict_vocab(torch.arange(VOCAB).flip(0), 8)
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, TreeParams(2, 2, 4)), 512, VOCAB)
    prompt = [11, 40, 2, 77]
    params = SamplingParams(temperature=1.0)
    n = 1200
    obs: dict[tuple[int, int], int] = {}
    for seed in range(n):
        out = tokens_of(engine, prompt, 2, sampling=SamplingParams(temperature=1.0, seed=seed))
        obs[tuple(out)] = obs.get(tuple(out), 0) + 1
    joint = _exact_joint(target, prompt, params)
    assert _chi_square_p(obs, joint, n) > 1e-3
    # the same test rejects a wrong law (temperature 0.6 instead of 1) at this sample size
    wrong = _exact_joint(target, prompt, SamplingParams(temperature=0.6))
    assert _chi_square_p(obs, wrong, n) < 1e-6


def _exact_joint(target, prompt, params) -> dict[tuple[int, int], float]:
    def probs(ids):
        out = target(torch.tensor(ids), target.new_cache(len(ids)), logits_for="last")
        return target_probs(out.logits[-1], params)
    p1 = probs(prompt)
    joint = {}
    for y1 in torch.nonzero(p1 > 1e-6).flatten().tolist():
        p2 = probs(prompt + [y1])
        for y2 in torch.nonzero(p2 > 1e-7).flatten().tolist():
            joint[(y1, y2)] = float(p1[y1] * p2[y2])
    return joint


def _chi_square_p(obs, joint, n) -> float:
    o, e, rest_o, rest_e = [], [], 0, 0.0
    for y, p in joint.items():
        if p * n >= 5:
            o.append(obs.get(y, 0))
            e.append(p * n)
        else:
            rest_o += obs.get(y, 0)
            rest_e += p * n
    rest_o += sum(c for y, c in obs.items() if y not in joint)
    o.append(rest_o)
    e.append(max(rest_e, 1e-9))
    e = [x * sum(o) / sum(e) for x in e]
    return float(stats.chisquare(o, e).pvalue)


def test_int8_target_speculative_equals_int8_plain(llama_pair):
    """Opt-in int8 target on the tiny models: speculative == aerie's own int8 plain decoding. (On the
    default model this does NOT hold on most prompts — docs/design.md "Cheaper rounds": verify and decode take
    different fp32 paths whose tiny differences int8 rounding amplifies.)"""
    hf, target, head = llama_pair
    q = quantize_linears(copy.deepcopy(target))
    assert isinstance(q.lm_head, QuantLinear) and isinstance(q.model.layers[0].self_attn.qkv_proj, QuantLinear)
    plain = Engine(Verifier(q), None, 512, VOCAB)
    spec = Engine(Verifier(q, head.feature_kind), Drafter(head, TREE), 512, VOCAB)
    differs = 0
    for prompt in PROMPTS:
        want = tokens_of(plain, prompt, 32)
        assert tokens_of(spec, prompt, 32) == want, prompt
        differs += want != hf_greedy(hf, prompt, 32)
    # int8 really changes the numerics (so this is not the fp32 test again) on at least one prompt
    logits_fp32 = target(torch.tensor(PROMPTS[0]), target.new_cache(16)).logits
    logits_int8 = q(torch.tensor(PROMPTS[0]), q.new_cache(16)).logits
    assert not torch.equal(logits_fp32, logits_int8)


def test_int8_linear_rows_do_not_depend_on_each_other():
    """Per-row activation scales: a row's output is the same in a 1-row and a 9-row call (a per-tensor
    scale, as torch's quantize_dynamic uses, makes verification differ from plain decoding)."""
    from services.model.linear import Linear

    torch.manual_seed(0)
    q = QuantLinear(Linear(64, 96))
    x = torch.randn(9, 64)
    x[4] *= 30  # one large row would change a per-tensor scale for all the others
    batch = q(x)
    for i in range(9):
        assert torch.equal(q(x[i:i + 1]), batch[i:i + 1])
    ref = torch.nn.functional.linear(x, q.wq_t.t().float() * q.w_scale[:, None], q.bias)
    torch.testing.assert_close(batch, ref, atol=0.05 * float(x.abs().max()), rtol=0.05)
