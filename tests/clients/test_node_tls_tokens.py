"""The Node clients' TLS, tokens and error reports (clients/node/chat.js, generate.js, security.js),
against fakes on loopback with test certificates generated here (tests/security/certs.py):

- chat.js over HTTPS checked against AERIE_TLS_CA sends AERIE_API_TOKEN as a bearer token, keeps a
  multi-byte character whole when the server splits it across writes, refuses a server whose
  certificate another CA signed, answers --help with exit 0 and names the reason when it cannot
  connect (not "fetch failed");
- generate.js over TLS sends the token as `authorization` metadata (Generate and Cancel alike).

Node and clients/node/node_modules come from scripts/setup.sh (`npm ci`).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from tests.security.certs import make_pki

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "node"
TOKEN = "node-client-token-0123456789"


@pytest.fixture(scope="module")
def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("node is not installed (the Node.js client needs Node >= 18)")
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run scripts/setup.sh (it runs `npm ci` there)")
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def run(node: str, script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AERIE_", "OPENAI_"))}
    return subprocess.run([node, str(CLIENT_DIR / script), *args], capture_output=True, text=True, timeout=60,
                          env={**clean, **(env or {})})


class _Chat(BaseHTTPRequestHandler):
    """/v1/models and a streamed chat completion whose "é" (2 bytes) is split across two writes."""
    seen: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
        self._send(200, json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, "authorization": self.headers.get("Authorization"), "body": body})
        if body.get("max_tokens") == 0:
            err = {"error": {"message": "max_tokens must be >= 1; got 0", "type": "invalid_request_error",
                             "param": "max_tokens", "code": None}}
            return self._send(400, json.dumps(err).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        event = ("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "café ok"},
                                                     "finish_reason": "stop"}]}, ensure_ascii=False) + "\n\n")
        raw = event.encode()
        cut = raw.index("é".encode()) + 1  # inside the two bytes of "é"
        for part in (raw[:cut], raw[cut:], b"data: [DONE]\n\n"):
            self.wfile.write(part)
            self.wfile.flush()


@pytest.fixture()
def https_server(pki):
    _Chat.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.leaf.cert, pki.leaf.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://localhost:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_chat_over_tls_with_a_token_keeps_characters_whole(node, pki, https_server):
    proc = run(node, "chat.js", "--url", https_server, "--prompt", "hi", "--json",
               env={"AERIE_TLS_CA": str(pki.ca.cert), "AERIE_API_TOKEN": TOKEN})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"text": "café ok", "finish_reason": "stop", "usage": None}
    assert [s["authorization"] for s in _Chat.seen] == [f"Bearer {TOKEN}"] * 2
    assert _Chat.seen[1]["body"]["model"] == "tiny" and TOKEN not in proc.stdout + proc.stderr


def test_chat_refuses_a_server_another_ca_signed(node, pki, https_server):
    proc = run(node, "chat.js", "--url", https_server, "--prompt", "hi", env={"AERIE_TLS_CA": str(pki.rogue_ca.cert)})
    assert proc.returncode == 1 and "cannot reach" in proc.stderr and "certificate" in proc.stderr, proc.stderr
    assert not _Chat.seen


def test_chat_reports_the_servers_error_and_the_reason_it_cannot_connect(node, pki, https_server):
    proc = run(node, "chat.js", "--url", https_server, "--prompt", "hi", "--max-tokens", "0",
               env={"AERIE_TLS_CA": str(pki.ca.cert)})
    assert proc.returncode == 1 and "HTTP 400: max_tokens must be >= 1; got 0" in proc.stderr, proc.stderr
    proc = run(node, "chat.js", "--url", "http://127.0.0.1:9/v1", "--prompt", "hi")  # nothing listens on 9
    assert proc.returncode == 1 and "cannot reach http://127.0.0.1:9/v1/models" in proc.stderr
    assert "ECONNREFUSED" in proc.stderr and "fetch failed" not in proc.stderr


@pytest.mark.parametrize("script", ["chat.js", "generate.js"])
def test_help_exits_0(node, script):
    proc = run(node, script, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {script}") and "AERIE_API_TOKEN" in proc.stdout


def test_an_unreadable_ca_file_is_a_usage_error(node, tmp_path):
    proc = run(node, "chat.js", "--prompt", "hi", env={"AERIE_TLS_CA": str(tmp_path / "missing.crt")})
    assert proc.returncode == 2 and "AERIE_TLS_CA=" in proc.stderr and "ENOENT" in proc.stderr


class _Coordinator(coordinator_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.metadata: list[dict] = []

    def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        yield cpb.GenerateResponse(sequence_id="s1", tokens=[7], stats=cpb.RoundStats(round_index=0), text="é",
                                   finish_reason="length")


def test_generate_over_tls_sends_the_token(node, pki):
    servicer = _Coordinator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_grpc.add_CoordinatorServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials([(pki.leaf.key.read_bytes(), pki.leaf.cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        env = {"AERIE_TLS_CA": str(pki.ca.cert), "AERIE_API_TOKEN": TOKEN, "AERIE_TLS_SERVER_NAME": "localhost"}
        proc = run(node, "generate.js", "--coordinator", f"127.0.0.1:{port}", "--prompt-ids", "1", "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["tokens"] == [7]
        assert servicer.metadata[0]["authorization"] == f"Bearer {TOKEN}"
        rogue = run(node, "generate.js", "--coordinator", f"127.0.0.1:{port}", "--prompt-ids", "1",
                    env={**env, "AERIE_TLS_CA": str(pki.rogue_ca.cert)})
        assert rogue.returncode == 1 and "UNAVAILABLE" in rogue.stderr and len(servicer.metadata) == 1
    finally:
        server.stop(0)
