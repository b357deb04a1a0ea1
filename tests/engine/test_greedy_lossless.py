"""Greedy speculative output == transformers generate(do_sample=False), token for token, in fp32."""

import zlib

import pytest
import torch

from services.engine.drafter import Drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.verifier import Verifier
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, hf_greedy

SHAPES = {"60/5/10": TreeParams(10, 5, 60), "16/3/4": TreeParams(4, 3, 16), "chain 8/7/1": TreeParams(1, 7, 8)}


def run(engine: Engine, prompt: list[int], n: int, **kw) -> tuple[list[int], list[int]]:
    tokens, accepts = [], []
    for step in engine.generate(GenerationRequest(tuple(prompt), n, **kw)):
        tokens += step.tokens
        if step.stats.round_index > 0:
            accepts.append(step.stats.accept_length)
    return tokens, accepts


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pair", ["llama_pair", "eagle3_pair"])
def test_greedy_equals_transformers(pair, shape, request):
    hf, target, head = request.getfixturevalue(pair)
    engine = Engine(Verifier(target, head.feature_kind), Drafter(head, SHAPES[shape]), 512, VOCAB)
    all_accepts = []
    for prompt in prompts(seed=zlib.crc32(shape.encode()) % 1000):
        tokens, accepts = run(engine, prompt, 48)
        assert tokens == hf_greedy(hf, prompt, 48), f"prompt {prompt}"
        all_accepts += accepts
    tau = sum(all_accepts) / len(all_accepts)
    # the heads are good enough that rounds accept several tokens, and some rounds reject
    assert tau > 1.8, all_accepts
    assert max(all_accepts) >= 4, all_accepts
    assert min(all_accepts) < SHAPES[shape].depth + 2 or shape.startswith("chain")


def test_baseline_equals_transformers(llama_pair):
    hf, target, _ = llama_pair
    engine = Engine(Verifier(target), None, 512, VOCAB)
    for prompt in prompts(seed=5):
        tokens, accepts = run(engine, prompt, 40)
        assert tokens == hf_greedy(hf, prompt, 40)
        assert set(accepts) == {1}


def test_eos_stops_like_transformers(llama_pair):
    """With an EOS id the output stops at it (included) and drops what the round produced after it."""
    hf, target, head = llama_pair
    prompt = prompts(seed=11, count=1)[0]
    free = hf_greedy(hf, prompt, 48)
    eos = free[20]  # a token the target really produces mid-way
    engine = Engine(Verifier(target), Drafter(head, SHAPES["60/5/10"]), 512, VOCAB, eos_token_ids=(eos,))
    tokens, _ = run(engine, prompt, 48)
    assert tokens == hf_greedy(hf, prompt, 48, eos=eos)
    assert tokens[-1] == eos and tokens.count(eos) == 1
    assert run(engine, prompt, 48, ignore_eos=True)[0] == free


def test_stop_token_ids_and_max_new_tokens(llama_pair):
    hf, target, head = llama_pair
    prompt = prompts(seed=12, count=1)[0]
    free = hf_greedy(hf, prompt, 30)
    engine = Engine(Verifier(target), Drafter(head, SHAPES["16/3/4"]), 512, VOCAB)
    stop = free[9]
    tokens, _ = run(engine, prompt, 30, stop_token_ids=(stop,))
    assert tokens == free[: free.index(stop) + 1]
    for n in (1, 2, 7):
        assert run(engine, prompt, n)[0] == free[:n]
    steps = list(engine.generate(GenerationRequest(tuple(prompt), 7)))
    assert steps[-1].finish_reason == "length" and all(s.finish_reason is None for s in steps[:-1])


def test_kv_released_after_generation(llama_pair):
    _, target, head = llama_pair
    verifier, drafter = Verifier(target), Drafter(head, SHAPES["16/3/4"])
    engine = Engine(verifier, drafter, 512, VOCAB)
    run(engine, [1, 2, 3], 10)
    gen = engine.generate(GenerationRequest((1, 2, 3), 50))
    next(gen), next(gen)
    assert verifier.num_sequences == 1 and drafter.num_sequences == 1
    gen.close()  # a client that stops reading: both sides release the sequence
    assert verifier.num_sequences == 0 and drafter.num_sequences == 0
