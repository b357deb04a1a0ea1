"""Through the verifier, in fp32 against transformers: a repetition penalty acts on the target's
distribution (greedy speculative output == transformers generate(repetition_penalty=...), token for
token), and `logprobs` are the target's log-probabilities of every committed token (and its top k),
equal to log_softmax of transformers' logits, whether a round accepted several draft tokens or none."""

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB

PROMPTS = [[5, 17, 9, 5, 17], [3, 3, 3, 40, 41, 42, 3], [100, 2, 64]]


def hf_penalized_greedy(hf, prompt: list[int], n: int, penalty: float) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, repetition_penalty=penalty,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def generate(engine: Engine, prompt: list[int], n: int, sampling: SamplingParams):
    tokens, logprobs, accepts = [], [], []
    for step in engine.generate(GenerationRequest(tuple(prompt), n, sampling)):
        tokens += step.tokens
        if sampling.logprobs is not None:
            assert step.logprobs is not None and step.logprobs.token_ids.tolist() == step.tokens
            logprobs.append(step.logprobs)
        if step.stats.round_index:
            accepts.append(step.stats.accept_length)
    return tokens, logprobs, accepts


@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
def test_greedy_repetition_penalty_equals_transformers(llama_pair, speculative):
    hf, target, head = llama_pair
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, TreeParams(4, 3, 16)) if speculative else None,
                    512, VOCAB)
    changed = 0
    for prompt in PROMPTS:
        tokens, _, _ = generate(engine, prompt, 40, SamplingParams(0.0, repetition_penalty=1.6))
        assert tokens == hf_penalized_greedy(hf, prompt, 40, 1.6), f"prompt {prompt}"
        changed += tokens != hf_penalized_greedy(hf, prompt, 40, 1.0)
    assert changed  # the penalty changed some output: the comparison tests something


@pytest.mark.parametrize("sampling", [SamplingParams(0.0, logprobs=3), SamplingParams(1.0, seed=4, logprobs=3),
                                      SamplingParams(0.7, top_k=5, repetition_penalty=1.3, seed=2, logprobs=0)],
                         ids=["greedy", "sampled", "processed"])
@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
def test_logprobs_are_the_targets(llama_pair, sampling, speculative):
    hf, target, head = llama_pair
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, TreeParams(4, 3, 16)) if speculative else None,
                    512, VOCAB)
    multi = 0
    for prompt in PROMPTS:
        tokens, parts, accepts = generate(engine, prompt, 30, sampling)
        multi += sum(a > 1 for a in accepts)
        got = type(parts[0]).cat(parts)
        assert got.token_ids.tolist() == tokens and len(got) == 30
        with torch.no_grad():  # raw target log-probabilities: no sampling processor applies
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
        ref = ref[len(prompt) - 1:len(prompt) - 1 + len(tokens)]  # row i predicts tokens[i]
        want = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(got.logprobs, want, atol=1e-4), (got.logprobs - want).abs().max()
        k = sampling.logprobs
        assert got.top_ids.shape == (30, k)
        if k:
            top = torch.topk(ref, k, dim=-1)
            assert torch.equal(got.top_ids, top.indices)
            assert torch.allclose(got.top_logprobs, top.values, atol=1e-4)
    assert multi or not speculative  # some rounds accepted draft tokens: their log-probabilities came from tree rows


def test_no_logprobs_unless_asked(llama_pair):
    _, target, head = llama_pair
    verifier = Verifier(target, head.feature_kind)
    engine = Engine(verifier, Drafter(head, TreeParams(4, 3, 16)), 512, VOCAB)
    steps = list(engine.generate(GenerationRequest((5, 17, 9), 12, SamplingParams(0.0))))
    assert all(s.logprobs is None for s in steps) and not verifier._logprobs
