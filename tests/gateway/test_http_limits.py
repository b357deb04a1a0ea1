"""The HTTP edge's limits (gateway/limits.py), against the real gateway (uvicorn on loopback) in front
of the real pipeline: each refusal has a precise status, and the body limit refuses from the
Content-Length before one byte of the body is read (the client here never sends the body)."""

import http.client
import json
import socket

import pytest

from gateway.limits import HttpLimits
from gateway.server import start_http
from tests.pipeline import HOST, start_pipeline, wait_until

LIMITS = HttpLimits(max_body_bytes=4096, max_header_bytes=2048, max_messages=3, max_connections_per_peer=2)


@pytest.fixture(scope="module")
def served(text_model_dirs, redis_url):
    p = start_pipeline(text_model_dirs, redis_url)
    http = p.loop.run(start_http(p.addresses["coordinator"], HOST, 0, limits=LIMITS))
    yield p, http.port
    p.loop.run(http.stop())
    p.close()


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            conn: http.client.HTTPConnection | None = None) -> tuple[int, dict]:
    conn = conn or http.client.HTTPConnection(HOST, port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    raw = r.read()
    return r.status, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")}


def post(port: int, path: str, obj: dict) -> tuple[int, dict]:
    return request(port, "POST", path, json.dumps(obj).encode())


def test_a_body_over_the_limit_is_413_from_its_content_length_before_it_is_read(served):
    _, port = served
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(200_000_000))
    conn.endheaders()  # the 200 MB body is never sent: the answer must not wait for it
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 413 and r.getheader("connection") == "close"
    assert "200000000 bytes" in body["error"]["message"] and "AERIE_HTTP_MAX_BODY_BYTES" in body["error"]["message"]
    conn.close()


def test_a_chunked_body_over_the_limit_is_413(served):
    """No Content-Length: refused once the streamed body passes the limit. The client sends one
    5,000-byte chunk and waits (it never ends the body), so everything it sent is read by the
    server and the answer is not lost to a reset."""
    _, port = served
    chunk = b'{"prompt": "t5", "max_tokens": 2' + b" " * (5000 - 34) + b"}"
    with socket.create_connection((HOST, port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        answer = b""
        while data := s.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413 ") and b"larger than 4096 bytes" in answer, answer[:300]


def test_a_body_under_the_limit_is_served(served):
    _, port = served
    status, body = post(port, "/v1/completions", {"prompt": "t5 t6", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 10**12, "max_tokens must be >= 0 and <= 2147483647; got 1000000000000"),  # (0: with echo)
    ("prompt", [5, 2**64], "prompt token ids must be in [0, 9223372036854775807]"),
    ("seed", 2**63, "seed must be >= 0 and <= 9223372036854775807"),  # (the engine's seed range)
    ("top_k", 2**40, "top_k must be >= -1 and <= 2147483647"),
])
def test_out_of_range_integers_are_400_naming_the_field(served, field, value, message):
    _, port = served
    body = {"prompt": "t5", "max_tokens": 2, field: value}
    status, answer = post(port, "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == field and message in answer["error"]["message"], answer


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_extra_routes_keep_the_body_limit(served, path):
    _, port = served
    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(200_000_000))
    conn.endheaders()  # never sent, as above
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 413 and r.getheader("connection") == "close" and "AERIE_HTTP_MAX_BODY_BYTES" in \
        body["error"]["message"]
    conn.close()


def test_too_many_messages_to_tokenize_is_400(served):
    _, port = served
    messages = [{"role": "user", "content": "t5"}] * 4
    status, answer = post(port, "/tokenize", {"messages": messages})
    assert status == 400 and answer["error"]["param"] == "messages" and "4 entries" in answer["error"]["message"]
    status, answer = post(port, "/tokenize", {"messages": messages[:3]})
    assert status == 200 and answer["count"] > 0


def test_too_many_chat_messages_is_400(served):
    _, port = served
    messages = [{"role": "user", "content": "t5"}] * 4
    status, answer = post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "messages"
    assert "4 entries" in answer["error"]["message"] and "AERIE_HTTP_MAX_MESSAGES" in answer["error"]["message"]
    status, _ = post(port, "/v1/chat/completions", {"messages": messages[:3], "max_tokens": 2})
    assert status == 200


def test_a_request_head_over_the_limit_is_431(served):
    _, port = served
    status, answer = request(port, "GET", "/metrics", headers={"X-Padding": "a" * 4000})
    assert status == 431 and "AERIE_HTTP_MAX_HEADER_BYTES" in answer["error"]["message"]
    status, _ = request(port, "GET", "/metrics", headers={"X-Padding": "a" * 1000})
    assert status == 200
    with socket.create_connection((HOST, port), timeout=60) as s:  # a head that never ends: not buffered
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 3000)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 ") and b"AERIE_HTTP_MAX_HEADER_BYTES" in answer


def test_connections_per_peer_are_limited(served):
    _, port = served
    held = [http.client.HTTPConnection(HOST, port, timeout=60) for _ in range(2)]
    for conn in held:  # answered, so the server counts both (they stay open: keep-alive)
        assert request(port, "GET", "/metrics", conn=conn)[0] == 200
    status, answer = request(port, "GET", "/metrics")
    assert status == 429 and "AERIE_HTTP_MAX_CONNECTIONS_PER_PEER" in answer["error"]["message"]
    assert request(port, "GET", "/metrics", conn=held[0])[0] == 200  # the open ones still work
    held[0].close()
    wait_until(lambda: request(port, "GET", "/metrics")[0] == 200)  # once the server saw the close
    held[1].close()
