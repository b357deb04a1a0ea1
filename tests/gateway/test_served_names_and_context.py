"""`aerie serve --max-model-len N --served-model-name A B` over real servers on loopback (the tiny target,
tests/pipeline.py) and the official openai client: /v1/models lists every name with max_model_len N,
a request may name any of them, and one whose prompt + max_tokens is over N gets vLLM's 400."""

import openai
import pytest

from tests.gateway.http_pipeline import openai_client, served_pipeline

MAX_MODEL_LEN = 40  # the tiny target's own context is 512


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url):
    yield from served_pipeline(text_model_dirs, redis_url, verifier_overrides={"max_model_len": MAX_MODEL_LEN},
                               served_model_name="tiny", model_aliases=("tiny-alias", "org/tiny"))


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def test_models_lists_every_name_with_max_model_len(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias", "org/tiny"]
    assert {m.model_extra["max_model_len"] for m in models} == {MAX_MODEL_LEN}


@pytest.mark.parametrize("name", ["tiny", "tiny-alias", "org/tiny"])
def test_a_request_may_use_any_name(client, name):
    r = client.completions.create(model=name, prompt=[5, 17, 9], max_tokens=4, temperature=0)
    assert r.model == "tiny" and r.usage.completion_tokens >= 1  # answers carry the first name, as vLLM's


def test_another_name_is_404_listing_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="target-x", prompt=[5], max_tokens=2)
    assert "'tiny' or 'tiny-alias' or 'org/tiny'" in e.value.body["message"]


def test_prompt_plus_max_tokens_over_max_model_len_is_400_naming_it(client):
    ok = client.completions.create(model="tiny", prompt=[5, 17, 9], max_tokens=MAX_MODEL_LEN - 3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.total_tokens == MAX_MODEL_LEN  # exactly at the limit: served in full
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5, 17, 9], max_tokens=MAX_MODEL_LEN - 2)
    err = e.value.body
    assert err["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
                                     f"requested {MAX_MODEL_LEN + 1} tokens: prompt (3 tokens) + max_tokens "
                                     f"({MAX_MODEL_LEN - 2}) = {MAX_MODEL_LEN + 1}")
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:  # chat: max_completion_tokens is named as sent
        client.chat.completions.create(model="org/tiny", messages=[{"role": "user", "content": "t5 t6"}],
                                       max_completion_tokens=MAX_MODEL_LEN)
    assert e.value.body["param"] == "max_completion_tokens"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.body["message"]


def test_a_chat_without_max_tokens_gets_what_the_context_leaves(client):
    """The default of 128 new tokens is cut to max_model_len - prompt, as vLLM sizes its default, instead
    of a refusal; an explicit max_tokens is never cut (it is refused above)."""
    content = " ".join(f"t{5 + i}" for i in range(20))
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], temperature=0,
                                       extra_body={"ignore_eos": True})
    assert 20 <= r.usage.prompt_tokens < MAX_MODEL_LEN and r.usage.total_tokens == MAX_MODEL_LEN
    assert r.choices[0].finish_reason == "length"
