"""What vLLM / SGLang users and common OpenAI clients send, against real servers on loopback (the tiny
target with the word-level tokenizer, tests/pipeline.py): fields with a neutral meaning are accepted,
min_p / repetition_penalty / stop_token_ids act, logprobs are the target's (checked against
transformers), errors are JSON in OpenAI's shape naming the OpenAI field, vLLM's /tokenize,
/detokenize and /version answer, and the model's generation_config.json supplies the defaults.

The served target's generation_config.json sets repetition_penalty 1.7 and top_k 1 (so a request
that sets neither samples the penalised argmax), and the coordinator caps new tokens at 100."""

import json
import shutil

import httpx
import pytest
import torch

from tests.gateway.http_pipeline import openai_client, served_pipeline, words
from tests.pipeline import ModelDirs

RAW = {"skip_special_tokens": False}
CAP = 100


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("generation-config")
    shutil.copytree(text_model_dirs.target, root / "target")
    config = json.loads((root / "target" / "generation_config.json").read_text())
    config.update(repetition_penalty=1.7, top_k=1)
    (root / "target" / "generation_config.json").write_text(json.dumps(config))
    yield from served_pipeline(ModelDirs(root / "target", text_model_dirs.head), redis_url, max_new_tokens=CAP)


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def complete(client, **kw) -> list[int]:
    kw = {"model": "target", "prompt": "t5 t17 t9", "max_tokens": 16, **kw}
    extra = {**RAW, **kw.pop("extra_body", {})}
    return words(client.completions.create(**kw, extra_body=extra).choices[0].text)


def test_generation_config_supplies_the_defaults(client):
    defaults = complete(client)  # temperature 1 (OpenAI's), top_k 1 and penalty 1.7 (the file's)
    assert defaults == complete(client, temperature=0, extra_body={"repetition_penalty": 1.7})
    plain = complete(client, temperature=0, extra_body={"repetition_penalty": 1.0})
    assert plain != defaults  # the penalty changed the output: the defaults were applied
    assert complete(client, extra_body={"repetition_penalty": 1.0}) == plain  # a body's value wins


def test_neutral_fields_are_accepted(client):
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7", "refusal": None},
                {"role": "user", "content": "t8"}]
    ref = client.chat.completions.create(model="target", messages=messages, max_tokens=8, temperature=0,
                                         extra_body=RAW)
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=8, temperature=0,
                                       metadata={"app": "x"}, store=False, response_format={"type": "text"},
                                       tool_choice="none", user="u1", extra_body=RAW)
    assert r.choices[0].message.content == ref.choices[0].message.content


def test_min_p_and_stop_token_ids(client):
    greedy = complete(client, temperature=0, extra_body={"repetition_penalty": 1.0})
    # min_p=1 keeps only the most likely token: sampling at temperature 1 is greedy
    assert complete(client, temperature=1, seed=3, extra_body={"min_p": 1.0, "top_k": 0,
                                                                 "repetition_penalty": 1.0}) == greedy
    stop = greedy[3]
    r = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=16, temperature=0,
                                  extra_body={**RAW, "repetition_penalty": 1.0, "stop_token_ids": [stop]})
    assert words(r.choices[0].text) == greedy[:greedy.index(stop) + 1]  # the stop token is kept
    assert r.choices[0].finish_reason == "stop"


def hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    return lp[len(prompt) - 1:len(prompt) - 1 + len(tokens)]  # row i predicts tokens[i]


def test_completion_logprobs_are_the_targets(client, llama_pair):
    hf = llama_pair[0]
    r = client.completions.create(model="target", prompt=[5, 17, 9], max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={**RAW, "repetition_penalty": 1.0})
    tokens, lp = words(r.choices[0].text), r.choices[0].logprobs
    ref = hf_logprobs(hf, [5, 17, 9], tokens)
    assert lp.tokens == [f"t{t}" for t in tokens]
    assert torch.allclose(torch.tensor(lp.token_logprobs), ref.gather(1, torch.tensor(tokens)[:, None])[:, 0],
                          atol=1e-4)
    top = torch.topk(ref, 3, dim=-1)
    for i, alternatives in enumerate(lp.top_logprobs):
        assert list(alternatives) == [f"t{t}" for t in top.indices[i].tolist()]
        assert torch.allclose(torch.tensor(list(alternatives.values())), top.values[i], atol=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(tokens))]
    # streamed: the same log-probabilities, spread over the chunks
    chunks = list(client.completions.create(model="target", prompt=[5, 17, 9], max_tokens=12, temperature=0,
                                            logprobs=3, stream=True,
                                            extra_body={**RAW, "repetition_penalty": 1.0}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_resume_streams_the_stored_logprobs(served, client):
    """A Resume (another coordinator, a client that reconnects) carries the same log-probabilities as the
    Generate stream: they are stored in Redis with the tokens."""
    import grpc

    from services.rpc.stubs import coordinator as cpb
    from services.rpc.stubs import coordinator_grpc

    r = client.completions.create(model="target", prompt=[5, 17, 9], max_tokens=10, temperature=0, logprobs=2,
                                  extra_body={**RAW, "repetition_penalty": 1.0, "ignore_eos": True})
    lp, seq_id = r.choices[0].logprobs, r.id.removeprefix("cmpl-")
    with grpc.insecure_channel(served[0].addresses["coordinator"]) as channel:
        stub = coordinator_grpc.CoordinatorStub(channel)
        resumed = list(stub.Resume(cpb.ResumeRequest(sequence_id=seq_id, from_token_index=4), timeout=60))
    got = [m.logprobs for m in resumed if m.HasField("logprobs")]
    assert [t for m in got for t in m.token_ids] == [t for m in resumed for t in m.tokens] == words(r.choices[0].text)[4:]
    assert [v for m in got for v in m.logprobs] == pytest.approx(lp.token_logprobs[4:], abs=1e-6)
    assert [m.top for m in got] == [2] * len(got)
    assert [t for m in got for t in m.top_texts] == [t for alt in lp.top_logprobs[4:] for t in alt]
    plain = client.completions.create(model="target", prompt=[5, 17, 9], max_tokens=3, temperature=0)
    with grpc.insecure_channel(served[0].addresses["coordinator"]) as channel:  # none asked: none stored
        again = list(coordinator_grpc.CoordinatorStub(channel).Resume(
            cpb.ResumeRequest(sequence_id=plain.id.removeprefix("cmpl-")), timeout=60))
    assert not any(m.HasField("logprobs") for m in again)


def test_chat_logprobs(client, llama_pair):
    r = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "t5 t6"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={**RAW, "repetition_penalty": 1.0})
    content = r.choices[0].logprobs.content
    tokens = words(r.choices[0].message.content)
    assert [c.token for c in content] == [f"t{t}" for t in tokens]
    prompt = [3, 5, 6, 4]  # the tiny chat template: "t3 <content> t4"
    ref = hf_logprobs(llama_pair[0], prompt, tokens)
    assert [c.logprob for c in content] == pytest.approx(
        ref.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(), abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)  # greedy
    assert content[0].bytes == list(content[0].token.encode())
    off = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "t5"}], max_tokens=2)
    assert off.choices[0].logprobs is None


BAD = [  # (endpoint, fields, param, text the message must contain)
    ("chat", {"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "tool_choice='auto'"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "got 21"),
    ("completions", {"logprobs": 6}, "logprobs", "got 6"),
    ("completions", {"min_p": 1.5}, "min_p", "got 1.5"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "got 0"),
    ("completions", {"stop_token_ids": ["x"]}, "stop_token_ids", "stop_token_ids must be"),
    ("completions", {"stop_token_ids": [100000]}, "stop_token_ids", "outside the vocabulary"),
    ("completions", {"metadata": {"a": 1}}, "metadata", "metadata must be"),
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs", "got -1"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs", "got 21"),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 needs echo=true"),
    ("completions", {"max_tokens": CAP + 1}, "max_tokens", f"max_tokens must be <= {CAP}"),
    ("chat", {"max_completion_tokens": CAP + 1}, "max_completion_tokens", f"<= {CAP}"),
    ("completions", {"prompt": [5] * 450, "max_tokens": CAP}, "max_tokens", "max_tokens (100)"),
    ("chat", {"messages": [{"role": "assistant", "content": "t5", "refusal": "no"}]}, "messages[0].refusal",
     "'no'"),
]


@pytest.mark.parametrize("endpoint,fields,param,text", BAD, ids=[b[2] + "-" + b[3][:12] for b in BAD])
def test_refusals_name_the_openai_field(served, endpoint, fields, param, text):
    body = ({"model": "target", "prompt": "t5 t6", "max_tokens": 4} if endpoint == "completions"
            else {"model": "target", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 4})
    body.update(fields)
    if "max_completion_tokens" in fields:
        body.pop("max_tokens")
    r = httpx.post(f"{served[1]}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}",
                   json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and text in err["message"], err
    assert "max_new_tokens" not in err["message"]


def test_404_and_405_are_openai_json(served):
    base = served[1]
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] is None
    r = httpx.get(base + "/v1/completions")
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"] and r.headers["allow"] == "POST"


def test_tokenize_detokenize_version_models(served, client):
    base = served[1]
    r = httpx.post(base + "/tokenize", json={"model": "target", "prompt": "t5 t17 t9", "return_token_strs": True})
    assert r.status_code == 200
    assert r.json() == {"count": 3, "max_model_len": 512, "tokens": [5, 17, 9], "token_strs": ["t5", "t17", "t9"]}
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "t5 t6"}]}).json()
    usage = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "t5 t6"}],
                                           max_tokens=1).usage
    assert chat["tokens"] == [3, 5, 6, 4] and chat["count"] == usage.prompt_tokens and chat["token_strs"] is None
    assert httpx.post(base + "/detokenize", json={"tokens": [5, 17, 9]}).json() == {"prompt": "t5 t17 t9"}
    bad = httpx.post(base + "/detokenize", json={"tokens": [5], "extra": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "extra"
    bad = httpx.post(base + "/detokenize", json={"tokens": [999]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert httpx.get(base + "/version").json() == {"version": "0.1.0"}
    doc = httpx.get(base + "/openapi.json").json()
    assert "/v1/chat/completions" in doc["paths"] and "CompletionRequest" in doc["components"]["schemas"]
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert (card["max_model_len"], card["max_tokens"]) == (512, CAP)


def test_logprobs_follow_the_stop_string_cut(client):
    """A stop string cuts the round's tokens on the coordinator (coordinator/text.py): the
    log-probabilities are cut with them, one per committed token."""
    greedy = complete(client, temperature=0, max_tokens=12, extra_body={"repetition_penalty": 1.0})
    stop = f"t{greedy[4]}"
    r = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=12, temperature=0, logprobs=1,
                                  stop=[stop], extra_body={**RAW, "repetition_penalty": 1.0})
    assert r.choices[0].finish_reason == "stop"
    n = greedy.index(greedy[4]) + 1  # tokens up to and including the one that completes the stop string
    assert r.usage.completion_tokens == n and len(r.choices[0].logprobs.token_logprobs) == n
    assert r.choices[0].logprobs.tokens == [f"t{t}" for t in greedy[:n]]
