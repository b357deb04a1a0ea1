"""The prompt's log-probabilities (SamplingParams.prompt_logprobs: OpenAI's echo + logprobs, vLLM's
prompt_logprobs) through the in-process verifier, in fp32 against transformers: row i of the prompt
scores token i+1, whole or in chunks (a chunk's last row scores the next chunk's first token), with
greedy, sampled and EAGLE-drafted generation after it, which they leave unchanged."""

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import PrefillCall, PrefillMoreCall, Verifier, merge_prefill
from services.errors import InvalidRequest
from services.spec.logprobs import prompt_logprobs
from services.spec.sampling import MAX_LOGPROBS, SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB

PROMPT = [5, 17, 9, 5, 17, 3, 3, 40, 41, 42, 3, 100, 2]


def reference(hf, prompt: list[int], k: int):
    """transformers' fp32 log-probabilities of prompt tokens 1..L-1 ([L-1]) and the top k ([L-1, k])."""
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]  # row i -> token i+1
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return want, torch.topk(ref, k, dim=-1), (ref > want[:, None]).sum(-1) + 1


def check(got, hf, prompt: list[int], k: int) -> None:
    want, top, ranks = reference(hf, prompt, k)
    assert got is not None and got.token_ids.tolist() == prompt[1:]
    assert torch.allclose(got.logprobs, want, atol=1e-4), (got.logprobs - want).abs().max()
    assert got.top_ids.shape == (len(prompt) - 1, k)
    assert torch.equal(got.top_ids, top.indices)
    assert torch.allclose(got.top_logprobs, top.values, atol=1e-4)
    assert torch.equal(got.ranks, ranks)


def test_a_whole_prompt_is_scored_by_the_targets_rows(llama_pair):
    hf, target, head = llama_pair
    v = Verifier(target, head.feature_kind)
    pre = v.prefill("s", torch.tensor(PROMPT), SamplingParams(0.0, prompt_logprobs=4), 64)
    check(pre.prompt_logprobs, hf, PROMPT, 4)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_a_chunked_prefill_scores_each_chunks_first_token_with_the_previous_chunks_last_row(llama_pair, chunk):
    hf, target, head = llama_pair
    v = Verifier(target, head.feature_kind)
    sampling = SamplingParams(0.0, prompt_logprobs=2)
    parts = torch.tensor(PROMPT).split(chunk)
    done = [v.run([PrefillCall("s", parts[0], sampling, 64, more=True, prompt_rows=len(PROMPT))])[0]]
    for i, part in enumerate(parts[1:], 1):
        done.append(v.run([PrefillMoreCall("s", part, last=i == len(parts) - 1)])[0])
    assert [len(d.prompt_logprobs) for d in done] == [len(parts[0]) - 1] + [len(p) for p in parts[1:]]
    merged = merge_prefill(done)
    check(merged.prompt_logprobs, hf, PROMPT, 2)
    whole = Verifier(target, head.feature_kind).prefill("w", torch.tensor(PROMPT), sampling, 64)
    assert merged.first_token == whole.first_token  # the first token is the last row's, as without chunks
    assert torch.equal(merged.features, whole.features) or torch.allclose(merged.features, whole.features, atol=1e-5)


@pytest.mark.parametrize("sampling", [SamplingParams(0.0, prompt_logprobs=3),
                                      SamplingParams(1.0, seed=7, logprobs=1, prompt_logprobs=0),
                                      SamplingParams(0.0, repetition_penalty=1.4, prompt_logprobs=5)],
                         ids=["greedy", "sampled", "penalised"])
@pytest.mark.parametrize("speculative", [True, False], ids=["eagle", "plain"])
def test_round_zero_carries_them_and_the_output_does_not_change(llama_pair, sampling, speculative):
    hf, target, head = llama_pair

    def run(params: SamplingParams):
        engine = Engine(Verifier(target, head.feature_kind),
                        Drafter(head, TreeParams(4, 3, 16)) if speculative else None, 512, VOCAB)
        return list(engine.generate(GenerationRequest(tuple(PROMPT), 20, params)))

    steps = run(sampling)
    check(steps[0].prompt_logprobs, hf, PROMPT, sampling.prompt_logprobs)  # raw: no penalty, no temperature
    assert all(s.prompt_logprobs is None for s in steps[1:])
    plain = run(SamplingParams(sampling.temperature, seed=sampling.seed, logprobs=sampling.logprobs,
                               repetition_penalty=sampling.repetition_penalty))
    assert [t for s in steps for t in s.tokens] == [t for s in plain for t in s.tokens]


def test_no_prompt_logprobs_unless_asked(llama_pair):
    _, target, head = llama_pair
    v = Verifier(target, head.feature_kind)
    assert v.prefill("s", torch.tensor(PROMPT), SamplingParams(0.0, logprobs=2), 64).prompt_logprobs is None
    one = v.prefill("t", torch.tensor([7]), SamplingParams(0.0, prompt_logprobs=2), 64).prompt_logprobs
    assert one is not None and len(one) == 0 and one.top_ids.shape == (0, 2)  # a 1-token prompt: nothing to score


def test_blocks_do_not_change_the_numbers():
    torch.manual_seed(0)
    logits, tokens = torch.randn(11, 50), torch.randint(0, 50, (11,))
    a, b = prompt_logprobs(logits, tokens, 3, block=4), prompt_logprobs(logits, tokens, 3, block=256)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.top_ids, b.top_ids)


@pytest.mark.parametrize("k", [-1, MAX_LOGPROBS + 1])
def test_out_of_range_is_refused_naming_the_field(k):
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=k)
