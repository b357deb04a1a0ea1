"""The prompt's log-probabilities over HTTP and gRPC, real servers on loopback (the tiny target with the
word-level tokenizer, greedy EAGLE drafting): `echo: true` with `logprobs` on /v1/completions (what
lm-evaluation-harness's local-completions loglikelihood tasks send), `max_tokens: 0` with echo, vLLM's
`prompt_logprobs` on both routes, across a chunked prefill (the verifier's chunk is 4 rows, the prompts
longer), each choice of a batch with its own prompt's, and equal to transformers' fp32 log_softmax."""

import grpc
import httpx
import pytest
import torch

from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from tests.gateway.http_pipeline import openai_client, served_pipeline, words

CHUNK = 4  # the verifier's prefill chunk: every prompt here spans several
PROMPT = [5, 17, 9, 5, 17, 3, 3, 40, 41, 42, 3]
TEXT = " ".join(f"t{t}" for t in PROMPT)
RAW = {"skip_special_tokens": False, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url):
    yield from served_pipeline(text_model_dirs, redis_url, verifier_overrides={"prefill_chunk": CHUNK})


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def hf_rows(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row i is transformers' fp32 log-distribution of ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]


def chosen(rows: torch.Tensor, ids: list[int]) -> list[float]:
    return rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_an_lm_eval_loglikelihood_request(served, llama_pair):
    """lm-eval's local-completions payload: token ids, max_tokens 1, greedy, logprobs 1, echo."""
    assert served[0].verifier.prefill_chunk == CHUNK < len(PROMPT)  # the prompt is prefilled in 3 chunks
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            **RAW}
    r = httpx.post(f"{served[1]}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(TEXT)  # echo: the prompt's text, then the completion's
    lp, generated = choice["logprobs"], words(choice["text"][len(TEXT):])
    assert len(generated) == 1
    ids = PROMPT + generated
    rows = hf_rows(llama_pair[0], ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert lp["token_logprobs"][1:] == pytest.approx(chosen(rows, ids), abs=1e-4)
    assert lp["tokens"][1:] == [f"t{t}" for t in ids[1:]]
    top = torch.topk(rows, 1, dim=-1)
    for i, alternatives in enumerate(lp["top_logprobs"][1:]):
        assert list(alternatives) == [f"t{top.indices[i, 0]}"]
        assert list(alternatives.values()) == pytest.approx([top.values[i, 0].item()], abs=1e-4)
    # lm-eval's is_greedy: the continuation token is the top-1 of its row (greedy decoding made it)
    assert list(lp["top_logprobs"][-1]) == [lp["tokens"][-1]]
    # offsets: 0 first, the completion's first token right after the prompt's text, never backwards
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets[len(PROMPT)] == len(TEXT) and offsets == sorted(offsets)
    assert r.json()["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 1,
                                 "total_tokens": len(PROMPT) + 1}


def test_echo_with_the_openai_client_and_max_tokens_zero(client, llama_pair):
    r = client.completions.create(model="target", prompt=TEXT, max_tokens=0, echo=True, logprobs=2, temperature=0,
                                  extra_body=RAW)
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"  # scores the prompt, shows no token
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    rows = hf_rows(llama_pair[0], PROMPT)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(chosen(rows, PROMPT), abs=1e-4)
    assert all(len(a) == 2 for a in choice.logprobs.top_logprobs[1:])
    # echo without logprobs: the text only
    plain = client.completions.create(model="target", prompt=TEXT, max_tokens=3, echo=True, temperature=0,
                                      extra_body=RAW)
    assert plain.choices[0].text.startswith(TEXT) and len(words(plain.choices[0].text[len(TEXT):])) == 3
    assert plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_on_both_routes(client, llama_pair):
    hf = llama_pair[0]
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={**RAW, "prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    rows = hf_rows(hf, PROMPT)
    assert got[0] is None and len(got) == len(PROMPT)
    top = torch.topk(rows, 2, dim=-1)
    for i, entry in enumerate(got[1:]):
        token = PROMPT[i + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(rows[i, token].item(), abs=1e-4)
        assert mine["rank"] == int((rows[i] > rows[i, token]).sum()) + 1 and mine["decoded_token"] == f"t{token}"
        for r_, (t, v) in enumerate(zip(top.indices[i].tolist(), top.values[i].tolist()), 1):
            assert entry[str(t)]["rank"] == r_ and entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
        assert set(entry) == {str(token), *map(str, top.indices[i].tolist())}
    assert r.choices[0].logprobs is None  # the completion's own were not asked for
    chat = client.chat.completions.create(model="target", messages=[{"role": "user", "content": TEXT}], max_tokens=2,
                                          temperature=0, extra_body={**RAW, "prompt_logprobs": 0})
    templated = [3, *PROMPT, 4]  # the tiny chat template: "t3 <content> t4"
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and [list(e) for e in got[1:]] == [[str(t)] for t in templated[1:]]
    assert [e[str(t)]["logprob"] for e, t in zip(got[1:], templated[1:])] == pytest.approx(
        chosen(hf_rows(hf, templated), templated), abs=1e-4)
    chunks = list(client.chat.completions.create(model="target", messages=[{"role": "user", "content": TEXT}],
                                                 max_tokens=2, temperature=0, stream=True,
                                                 extra_body={**RAW, "prompt_logprobs": 0}))
    assert chunks[0].model_extra["prompt_logprobs"] == got  # streamed: with the first chunk
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in chunks[1:])


def test_each_choice_carries_its_own_prompts(client, llama_pair):
    other = [7, 8, 9, 10, 11, 12]
    r = client.completions.create(model="target", prompt=[PROMPT, other], n=2, max_tokens=2, temperature=0, echo=True,
                                  logprobs=0, extra_body=RAW)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice, prompt in zip(r.choices, [PROMPT, PROMPT, other, other]):
        assert choice.text.startswith(" ".join(f"t{t}" for t in prompt))  # (token ids: decoded by the coordinator)
        assert choice.logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
            chosen(hf_rows(llama_pair[0], prompt), prompt), abs=1e-4)


def test_streamed_echo_sends_the_prompt_first(client):
    whole = client.completions.create(model="target", prompt=TEXT, max_tokens=4, echo=True, logprobs=1,
                                      temperature=0, extra_body=RAW)
    chunks = [c for c in client.completions.create(model="target", prompt=TEXT, max_tokens=4, echo=True, logprobs=1,
                                                   temperature=0, stream=True, extra_body=RAW) if c.choices]
    assert chunks[0].choices[0].text == TEXT
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-6)
    offsets = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset


@pytest.mark.parametrize("fields,param", [({"prompt_logprobs": -1}, "prompt_logprobs"),
                                          ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                          ({"max_tokens": 0}, "max_tokens"),
                                          ({"echo": "yes"}, "echo")])
def test_bad_values_are_a_400_naming_the_field(served, fields, param):
    r = httpx.post(f"{served[1]}/v1/completions", json={"model": "target", "prompt": TEXT, **fields}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_grpc_plain_decoding_and_resume(served, redis_url, llama_pair):
    """The coordinator's first GenerateResponse carries them also without a drafter; a Resume from
    token 0 does not send them again (they are not stored)."""
    p = served[0]
    _, address = p.add_coordinator(redis_url, drafters=())
    request = cpb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=3,
                                  sampling=pb.SamplingParams(temperature=0.0, prompt_logprobs=1))
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_grpc.CoordinatorStub(channel)
        messages = list(stub.Generate(request, timeout=120))
        resumed = list(stub.Resume(cpb.ResumeRequest(sequence_id=messages[0].sequence_id, from_token_index=0),
                                   timeout=60))
    first = messages[0].prompt_logprobs
    assert list(first.token_ids) == PROMPT[1:] and first.top == 1 and len(first.ranks) == len(PROMPT) - 1
    assert list(first.token_texts) == [f"t{t}" for t in PROMPT[1:]]
    assert list(first.logprobs) == pytest.approx(chosen(hf_rows(llama_pair[0], PROMPT), PROMPT), abs=1e-4)
    assert not any(m.HasField("prompt_logprobs") for m in messages[1:] + resumed)
    assert [t for m in resumed for t in m.tokens] == [t for m in messages for t in m.tokens]
