"""Several choices per request: `n` and a batch of prompts (/v1/completions), through the official
`openai` client against real servers on loopback (tests/gateway/http_pipeline.py). Each choice is a
sequence of its own; choice k of a prompt samples with seed + k, so it equals that prompt sent alone
with that seed, and the batch's composition changes nothing."""

import pytest

from tests.gateway.http_pipeline import openai_client, served_pipeline, words

RAW = {"skip_special_tokens": False}  # text <-> tokens is a bijection on the tiny vocabulary


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url):
    yield from served_pipeline(text_model_dirs, redis_url)


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def alone(client, prompt, seed: int, **kw) -> str:
    r = client.completions.create(model="target", prompt=prompt, max_tokens=12, temperature=1.0, seed=seed,
                                  extra_body=RAW, **kw)
    assert len(r.choices) == 1 and r.choices[0].index == 0
    return r.choices[0].text


def test_n_choices_are_the_seeds_in_turn(client):
    r = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=12, temperature=1.0, seed=7, n=3,
                                  extra_body=RAW)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert texts == [alone(client, "t5 t17 t9", 7 + k) for k in range(3)]
    assert len(set(texts)) > 1  # sampled with different seeds: not three copies
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, sum(len(words(t)) for t in texts))
    assert all(c.finish_reason == "length" for c in r.choices) and r.id.startswith("cmpl-")


def test_a_batch_of_prompts_gives_each_prompt_its_choices_in_order(client):
    prompts = ["t5 t17 t9", [7, 8], "t3"]
    r = client.completions.create(model="target", prompt=prompts, max_tokens=12, temperature=1.0, seed=11, n=2,
                                  extra_body=RAW)
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate(prompts):  # prompt i's choices at [2i, 2i + 2): as if sent alone
        assert [c.text for c in r.choices[2 * i:2 * i + 2]] == [alone(client, prompt, 11 + k) for k in range(2)]
    assert r.usage.prompt_tokens == 3 + 2 + 1
    assert r.usage.completion_tokens == sum(len(words(c.text)) for c in r.choices)


def test_streamed_choices_carry_their_index_and_equal_the_whole_answer(client):
    whole = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "t5 t6"}],
                                           max_tokens=10, temperature=1.0, seed=3, n=2, extra_body=RAW)
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "t5 t6"}], max_tokens=10, temperature=1.0, seed=3,
        n=2, stream=True, stream_options={"include_usage": True}, extra_body=RAW))
    texts = {0: "", 1: ""}
    roles, ends = [], {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.append(choice.index)
        if choice.finish_reason:
            ends[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert sorted(roles) == [0, 1] and ends == {0: "length", 1: "length"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


def test_greedy_choices_are_equal(client):
    r = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=12, temperature=0, n=2,
                                  extra_body=RAW)
    assert r.choices[0].text == r.choices[1].text and len(words(r.choices[0].text)) == 12


def test_a_client_that_disconnects_cancels_every_choice(served):
    import httpx

    from tests.pipeline import wait_until

    p, base = served
    body = {"model": "target", "prompt": ["t5 t6", "t7"], "n": 2, "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
        assert p.verifier.num_sequences == 4  # one sequence per choice
    # the connection is closed: every choice's sequence stops and frees its KV on both services
    wait_until(lambda: p.verifier.num_sequences == 0 and p.drafter.drafter.num_sequences == 0)
