"""The OpenAI-compatible HTTP API, driven by the official `openai` Python client (and httpx where
the client hides the wire) against real servers on loopback: verifier, drafter, coordinator (gRPC)
and the HTTP API on port 0, Redis, the tiny target with the word-level tokenizer (tests/pipeline.py).

The tiny tokenizer maps each token to one word ("t0" .. "t127", joined by spaces), so with
skip_special_tokens=false the text determines the tokens: text equality is token equality."""

import json
import threading

import httpx
import openai
import pytest
import redis

from gateway.server import start_http
from aerie_cli.main import main as aerie_main
from tests.gateway.http_pipeline import openai_client, served_pipeline, words
from tests.pipeline import HOST, wait_until

RAW = {"skip_special_tokens": False}  # text <-> tokens is then a bijection on the tiny vocabulary


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url):
    yield from served_pipeline(text_model_dirs, redis_url)


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def test_greedy_completion_equals_aerie_generate_in_process(client, text_model_dirs, capsys):
    r = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=32, temperature=0,
                                  extra_body=RAW)
    code = aerie_main(["generate", "--target", str(text_model_dirs.target), "--draft", str(text_model_dirs.head),
                       "--dtype", "fp32", "--prompt-ids", "5,17,9", "--max-new-tokens", "32", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert words(r.choices[0].text) == json.loads(out)["tokens"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 32, 35)
    assert r.model == "target" and r.object == "text_completion"


def test_token_id_prompt_and_streaming_match(client):
    whole = client.completions.create(model="target", prompt=[5, 17, 9], max_tokens=20, temperature=0,
                                      extra_body=RAW)
    chunks = list(client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=RAW))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and len(words(text)) == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "t5 t6"}]
    whole = client.chat.completions.create(model="target", messages=messages, max_completion_tokens=16,
                                           temperature=0, extra_body=RAW)
    # TINY_CHAT_TEMPLATE by hand: "t3 t5 t6 t4"
    plain = client.completions.create(model="target", prompt=[3, 5, 6, 4], max_tokens=16, temperature=0,
                                      extra_body=RAW)
    assert whole.choices[0].message.content == plain.choices[0].text
    assert whole.choices[0].message.role == "assistant" and whole.usage.prompt_tokens == 4
    stream = list(client.chat.completions.create(model="target", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, extra_body=RAW))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == plain.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_strings(client):
    ref = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=30, temperature=0,
                                    extra_body=RAW).choices[0].text
    stop = ref.split(" ")[4][:2]  # the start of the fifth word: ends inside that token
    cut = ref[:ref.index(stop)]
    r = client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=30, temperature=0, stop=stop,
                                  extra_body=RAW)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(cut.split()) + 1  # through the token that completes the stop
    chunks = list(client.completions.create(model="target", prompt="t5 t17 t9", max_tokens=30, temperature=0,
                                            stop=["zzz", stop], stream=True, extra_body=RAW))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


BAD = [  # (endpoint, fields, param, text the message must contain)
    ("completions", {"n": 65}, "n", "got 65"),
    ("completions", {"best_of": 3}, "best_of", "best_of=3"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "top_logprobs=2"),
    ("completions", {"temperature": 3}, "temperature", "got 3"),
    ("completions", {"top_p": 0}, "top_p", "got 0"),
    ("completions", {"top_k": -2}, "top_k", "got -2"),
    ("completions", {"seed": -1}, "seed", "got -1"),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 needs echo=true"),
    ("chat", {"max_completion_tokens": -5}, "max_completion_tokens", "got -5"),
    ("completions", {"stop": [""]}, "stop", "stop[0] is an empty string"),
    ("completions", {"stop": 7}, "stop", "got 7"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5"),
    ("completions", {"echo": 1}, "echo", "echo: Input should be a valid boolean"),
    ("completions", {"prompt": ["t5", "t6"], "n": 33}, "n", "2 prompts x n=33 is 66 choices"),
    ("completions", {"prompt": ["t5", ""]}, "prompt", "prompt[1] is an empty string"),
    ("completions", {"prompt": "t5", "frobnicate": 1}, "frobnicate", "frobnicate=1"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools="),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]",
     "image_url"),
]


def _bad_call(client, endpoint, fields):
    if endpoint == "completions":
        kw = {"model": "target", "prompt": "t5 t6", "max_tokens": 4}
        kw.update(fields)
        extra = {k: kw.pop(k) for k in list(kw) if k in ("top_k", "frobnicate")}
        return client.completions.create(**kw, extra_body=extra or None)
    kw = {"model": "target", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 4}
    kw.update(fields)
    return client.chat.completions.create(**kw)


def test_bad_parameters_are_400_naming_field_and_value_and_commit_nothing(served, client, redis_url):
    p, _ = served
    ref = client.completions.create(model="target", prompt="t8 t9", max_tokens=120, temperature=0,
                                    extra_body=RAW).choices[0].text
    db = redis.Redis.from_url(redis_url)
    keys_before = db.dbsize()
    healthy: dict = {}

    def stream():  # a concurrent healthy request
        chunks = client.completions.create(model="target", prompt="t8 t9", max_tokens=120, temperature=0,
                                           stream=True, extra_body=RAW)
        healthy["text"] = "".join(c.choices[0].text for c in chunks)

    t = threading.Thread(target=stream)
    t.start()
    for endpoint, fields, param, text in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            _bad_call(client, endpoint, fields)
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == param, (fields, err)
        assert text in err["message"] and err["type"] == "invalid_request_error", (fields, err)
    t.join(60)
    assert healthy["text"] == ref
    assert db.dbsize() == keys_before + 2  # the healthy stream's two keys; the bad requests none
    wait_until(lambda: p.verifier.num_sequences == 0)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-7", prompt="t5", max_tokens=2)
    assert "gpt-7" in e.value.body["message"] and e.value.body["param"] == "model"


def test_prompt_longer_than_the_context(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="target", prompt=[5] * 600, max_tokens=4)
    msg = e.value.body["message"]
    assert "600 tokens" in msg and "512" in msg


def test_client_disconnect_cancels_the_sequence(served):
    p, base = served
    body = {"model": "target", "prompt": "t5 t6", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h, h.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        seq_id = json.loads(first[6:])["id"].removeprefix("cmpl-")
        assert p.verifier.num_sequences == 1
    # the connection is closed: the sequence stops after its round in flight and frees its KV
    wait_until(lambda: p.verifier.num_sequences == 0 and p.drafter.drafter.num_sequences == 0)
    wait_until(lambda: p.coordinator.store.get(seq_id).status == "cancelled")
    assert len(p.coordinator.store.get(seq_id).tokens) < 400


def test_models_health_metrics(served, client):
    p, base = served
    assert [m.id for m in client.models.list()] == ["target"]
    h = httpx.get(base + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = client.completions.create(model="target", prompt="t5 t6", max_tokens=24, temperature=0)
    reason = r.choices[0].finish_reason  # "stop": the tiny tokenizer's EOS (t2) ends this prompt early
    text = httpx.get(base + "/metrics").text

    def value(name: str, **labels) -> float:
        want = {f'{k}="{v}"' for k, v in {"model_name": "target", **labels}.items()}
        for line in text.splitlines():
            metric, _, rest = line.partition("{")
            if metric == name and set(rest.partition("}")[0].split(",")) == want:
                return float(line.split()[-1])
        raise AssertionError(f"no {name} {labels}")

    drafts, drafted = value("aerie:spec_decode_num_drafts_total"), value("aerie:spec_decode_num_draft_tokens_total")
    accepted = value("aerie:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafted
    per_pos = [value("aerie:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(16)
               if f'position="{i}"' in text]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert value("aerie:time_to_first_token_seconds_count") > 0
    assert value("aerie:e2e_request_latency_seconds_count") > 0
    assert value("aerie:inter_token_latency_seconds_count") > 0
    assert value("aerie:num_requests_running") == 0 and value("aerie:num_requests_waiting") == 0
    assert value("aerie:request_success_total", finished_reason=reason) > 0


def test_health_is_503_without_a_drafter(served, redis_url):
    p, _ = served
    _, address = p.add_coordinator(redis_url, drafters=(f"{HOST}:1",))  # nothing listens on port 1
    http = p.loop.run(start_http(address, HOST, 0))
    try:
        h = httpx.get(f"http://{HOST}:{http.port}/health", timeout=30)
        assert h.status_code == 503
        assert (h.json()["verifiers_ready"], h.json()["drafters_ready"]) == (1, 0)
    finally:
        p.loop.run(http.stop())
