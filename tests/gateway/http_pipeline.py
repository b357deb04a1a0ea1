"""The HTTP gateway in front of a test pipeline, and the openai client the gateway tests use."""

from __future__ import annotations

from collections.abc import Iterator

import openai

from gateway.server import start_http
from tests.pipeline import HOST, start_pipeline


def served_pipeline(dirs, redis_url: str, **kw) -> Iterator[tuple[object, str]]:
    """A fixture body: (pipeline, the gateway's base URL), stopped after the yield."""
    p = start_pipeline(dirs, redis_url, **kw)
    http = p.loop.run(start_http(p.addresses["coordinator"], HOST, 0))
    yield p, f"http://{HOST}:{http.port}"
    p.loop.run(http.stop())
    p.close()


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def words(text: str) -> list[int]:
    """The token ids of the tiny model's text (`t5 t17` -> [5, 17])."""
    return [int(w[1:]) for w in text.split()]
