"""The default model (SmolLM2-135M-Instruct GGUF, the shipped EAGLE head) behind the HTTP API: a
chat request with the official openai client answers like `aerie generate` in process (same chat
template, same greedy text), and a stop string cuts it."""

import json
from pathlib import Path

import openai
import pytest

from gateway.server import start_http
from aerie_cli.main import main as aerie_main
from services.engine.local import DEFAULT_HEAD
from services.model.loading import find_default_gguf
from tests.pipeline import HOST, ModelDirs, TREE, start_pipeline

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(redis_url):
    p = start_pipeline(ModelDirs(Path(find_default_gguf()), DEFAULT_HEAD), redis_url, max_prompt_tokens=512)
    http = p.loop.run(start_http(p.addresses["coordinator"], HOST, 0))
    yield openai.OpenAI(base_url=f"http://{HOST}:{http.port}/v1", api_key="unused", max_retries=0, timeout=120)
    p.loop.run(http.stop())
    p.close()


def test_chat_equals_aerie_generate_in_process(client, capsys):
    [model] = client.models.list().data
    r = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert aerie_main(["generate", "--prompt", QUESTION, "--max-new-tokens", "12", "--dtype", "fp32",
                       "--tree-top-k", str(TREE.top_k), "--tree-depth", str(TREE.depth),
                       "--tree-tokens", str(TREE.size), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert text == local["text"] and r.usage.prompt_tokens == local["prompt_tokens"]
    assert r.usage.completion_tokens == len(local["tokens"])
    stop = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0, stop=["Paris"])
    assert stop.choices[0].message.content == text[:text.index("Paris")]
    assert stop.choices[0].finish_reason == "stop"
