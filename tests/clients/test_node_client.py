"""The Node.js client (clients/node/generate.js) against the real contract.

Two layers:
- a fake Coordinator (Python gRPC on 127.0.0.1:0, generated stubs) pins down what the client sends,
  that it prints tokens as they arrive, and how it reports errors and Ctrl-C;
- `aerie up` with a tiny random model saved by the test runs the whole pipeline, and the Node
  client's tokens must equal the Python client's (`aerie generate --coordinator ... --json`), greedy
  and seeded-sampled.

Node and clients/node/node_modules come from scripts/setup.sh (`npm ci`); without them these tests
fail rather than skip.
"""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.rpc.stubs import common as common_pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "node"
GENERATE_JS = CLIENT_DIR / "generate.js"
AERIE = Path(sys.executable).with_name("aerie")
HTTP_URL: list[str] = []  # the OpenAI-compatible API's base URL, as `aerie up` printed it


@pytest.fixture(scope="module")
def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("node is not installed (the Node.js client needs Node >= 18)")
    if not (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("clients/node/node_modules is missing: run scripts/setup.sh (it runs `npm ci` there)")
    return path


def run_node(node: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([node, str(GENERATE_JS), *args], capture_output=True, text=True, timeout=timeout)


# --- a fake coordinator -------------------------------------------------------------------------

class FakeCoordinator(coordinator_grpc.CoordinatorServicer):
    """Streams canned rounds; records what it was asked. `gate` (when set) holds the stream after the
    first message until the test releases it."""

    SEQ = "seq-fake-1"

    def __init__(self) -> None:
        self.requests: list[cpb.GenerateRequest] = []
        self.cancels: list[str] = []
        self.gate: threading.Event | None = None
        self.abort: tuple[grpc.StatusCode, str] | None = None

    def Generate(self, request, context):
        self.requests.append(request)
        if self.abort:
            context.abort(*self.abort)
        info = cpb.SequenceInfo(placement=cpb.Placement(drafter="d:1", verifier="v:1"), target="t", draft="h",
                                tree=common_pb.TreeParams(top_k=4, depth=3, total_tokens=16))
        yield cpb.GenerateResponse(sequence_id=self.SEQ, tokens=[11], stats=cpb.RoundStats(round_index=0), info=info,
                                   text="Hé")
        if self.gate is not None:
            # Hold until released or cancelled (the Ctrl-C test never releases it).
            while context.is_active() and not self.gate.wait(0.05):
                pass
            if not context.is_active():
                return
        yield cpb.GenerateResponse(sequence_id=self.SEQ, tokens=[12, 13, 14], text="llo 🦀",
                                   stats=cpb.RoundStats(round_index=1, accept_length=3, tree_size=16, tree_max_depth=3))
        # as an older coordinator sends it: the round's number only in the deprecated `index`
        yield cpb.GenerateResponse(sequence_id=self.SEQ, tokens=[2**40 + 5], finish_reason="length", text="!",
                                   stats=cpb.RoundStats(index=2, accept_length=1, tree_size=16, tree_max_depth=3))

    def Cancel(self, request, context):
        self.cancels.append(request.sequence_id)
        if self.gate is not None:
            self.gate.set()
        return cpb.CancelResponse(status=cpb.SEQUENCE_STATUS_RUNNING)


@pytest.fixture()
def fake():
    servicer = FakeCoordinator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    coordinator_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_json_output_and_request_encoding(node, fake):
    servicer, address = fake
    proc = run_node(node, "--coordinator", address, "--prompt-ids", "1,2,3", "--max-new-tokens", "20",
                    "--temperature", "0.7", "--top-k", "40", "--seed", "9", "--stop-token-ids", "7,8",
                    "--ignore-eos", "--sequence-id", "my-seq", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == [11, 12, 13, 14, 2**40 + 5]  # int64 beyond 32 bits survives
    assert out["finish_reason"] == "length"
    assert out["sequence_id"] == FakeCoordinator.SEQ
    assert out["accept_lengths"] == [3, 1] and out["rounds"] == 2 and out["tau"] == 2.0
    assert out["info"]["placement"] == {"drafter": "d:1", "verifier": "v:1"}
    [req] = servicer.requests
    assert list(req.prompt_ids) == [1, 2, 3]
    assert req.HasField("max_new_tokens") and req.max_new_tokens == 20
    assert req.sampling.temperature == pytest.approx(0.7) and req.sampling.top_k == 40 and req.sampling.seed == 9
    assert not req.sampling.HasField("top_p")  # unset = off, as the proto says
    assert list(req.stop_token_ids) == [7, 8] and req.ignore_eos and req.sequence_id == "my-seq"


def test_optional_fields_stay_unset(node, fake):
    servicer, address = fake
    proc = run_node(node, "--coordinator", address, "--prompt-ids", "5", "--top-p", "0.9", "--json")
    assert proc.returncode == 0, proc.stderr
    [req] = servicer.requests
    assert not req.HasField("max_new_tokens")  # the coordinator's default applies
    assert req.sampling.HasField("top_p") and req.sampling.top_p == pytest.approx(0.9)
    assert req.sampling.temperature == 0 and not req.ignore_eos and req.sequence_id == ""


def test_text_request_and_text_output(node, fake):
    servicer, address = fake
    proc = run_node(node, "--coordinator", address, "--prompt", "Hi there", "--stop", "\n", "--stop", "END")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Hé" + "llo 🦀" + "!" + "\n"  # the text deltas, printed as they arrive
    proc = run_node(node, "--coordinator", address, "--prompt", "Hi", "--chat", "--json")
    assert json.loads(proc.stdout)["text"] == "Héllo 🦀!"
    plain, chat = servicer.requests
    assert plain.HasField("prompt") and plain.prompt == "Hi there" and list(plain.stop) == ["\n", "END"]
    assert not plain.prompt_ids and not plain.messages
    assert not chat.HasField("prompt") and [(m.role, m.content) for m in chat.messages] == [("user", "Hi")]


def test_tokens_are_printed_as_they_arrive(node, fake):
    """The first round's tokens reach stdout while the server still holds the rest of the stream."""
    servicer, address = fake
    servicer.gate = threading.Event()
    proc = subprocess.Popen([node, str(GENERATE_JS), "--coordinator", address, "--prompt-ids", "1,2",
                             "--max-new-tokens", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no output while the stream was open"
        first = os.read(proc.stdout.fileno(), 100).decode()
        assert first.split() == ["11"]
        assert proc.poll() is None
        servicer.gate.set()
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (first + rest).split() == ["11", "12", "13", "14", str(2**40 + 5)]
    assert "5 tokens, 2 rounds, tau 2.00" in err and "finish: length" in err


def test_ctrl_c_cancels_the_sequence(node, fake):
    servicer, address = fake
    servicer.gate = threading.Event()
    proc = subprocess.Popen([node, str(GENERATE_JS), "--coordinator", address, "--prompt-ids", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready
        os.read(proc.stdout.fileno(), 100)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert servicer.cancels == [FakeCoordinator.SEQ]
    assert "cancelled" in err


def test_rpc_errors_are_reported(node, fake):
    servicer, address = fake
    servicer.abort = (grpc.StatusCode.INVALID_ARGUMENT, "prompt has 9000 tokens; the limit is 8192")
    proc = run_node(node, "--coordinator", address, "--prompt-ids", "1", "--json")
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT: prompt has 9000 tokens; the limit is 8192" in proc.stderr
    proc = run_node(node, "--coordinator", "127.0.0.1:1", "--prompt-ids", "1", "--timeout", "5")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


@pytest.mark.parametrize("args,message", [
    ([], "--coordinator is required"),
    (["--coordinator", "h:1"], "--prompt or --prompt-ids is required"),
    (["--coordinator", "h:1", "--prompt", "x", "--prompt-ids", "1"], "give --prompt or --prompt-ids, not both"),
    (["--coordinator", "h:1", "--prompt-ids", "1,a"], "--prompt-ids must be comma-separated integers"),
    (["--coordinator", "h:1", "--prompt-ids", "1", "--max-new-tokens", "2.5"], "--max-new-tokens must be an integer"),
    (["--coordinator", "h:1", "--prompt-ids", "1", "--bogus"], "unknown argument --bogus"),
])
def test_bad_arguments_exit_2(node, args, message):
    proc = run_node(node, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# --- the real pipeline --------------------------------------------------------------------------

def save_tiny_models(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama (Hugging Face format) and an untrained EAGLE-2 head for it. The head drafts
    badly, which is fine: output is lossless whatever the drafts, and rounds still run the tree."""
    import torch

    from services.model.eagle_head import HeadConfig, build_head
    from services.model.head_checkpoint import save_head
    from tests.helpers import HIDDEN, VOCAB, save_tiny_tokenizer, tiny_hf, to_native

    hf = tiny_hf("llama", layers=2, seed=3)
    hf.save_pretrained(root / "target")
    save_tiny_tokenizer(root / "target")  # the coordinator speaks text ("t0" .. "t127"), chat included
    from transformers import AutoTokenizer

    from tests.pipeline import TINY_CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(str(root / "target"))
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(str(root / "target"))
    target = to_native(hf)
    torch.manual_seed(3)
    head = build_head(HeadConfig("eagle", HIDDEN, 128, 4, 2, 1e-6, VOCAB), target.lm_head)
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    save_head(head, root / "head")
    return root / "target", root / "head"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    return save_tiny_models(tmp_path_factory.mktemp("node-client"))


@pytest.fixture(scope="module")
def pipeline(tiny_models):
    """`aerie up` on loopback with the tiny models; yields the coordinator's host:port."""
    target, head = tiny_models
    root = target.parent
    log = open(root / "up.log", "w")
    proc = subprocess.Popen([str(AERIE), "up", "--target", str(target), "--draft", str(head), "--dtype", "fp32",
                             "--tree-top-k", "4", "--tree-depth", "3", "--tree-tokens", "16",
                             "--host", "127.0.0.1", "--port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=root)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # a thread, so a line already buffered is never missed by select()
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    address = None
    deadline = time.monotonic() + 300
    try:
        while address is None or not HTTP_URL:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if not line:
                log.flush()
                pytest.fail(f"aerie up did not become ready:\n{(root / 'up.log').read_text()[-3000:]}")
            if line.startswith("coordinator"):
                address = line.split()[1]
            if line.startswith("http"):
                HTTP_URL.append(line.split()[1])
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def python_generate(address: str, *args: str) -> dict:
    proc = subprocess.run([str(AERIE), "generate", "--coordinator", address, "--json", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def python_tokens(address: str, *args: str) -> list[int]:
    return python_generate(address, *args)["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.95", "--top-k", "50", "--seed", "7"]],
                         ids=["greedy", "sampled"])
def test_node_client_matches_python_client(node, pipeline, sampling):
    args = ["--prompt-ids", "1,2,3,4", "--max-new-tokens", "20", "--ignore-eos", *sampling]
    expected = python_tokens(pipeline, *args)
    assert len(expected) == 20
    proc = run_node(node, "--coordinator", pipeline, *args, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == expected
    assert out["finish_reason"] == "length"
    assert out["info"]["draft"] and out["info"]["tree"] == {"top_k": 4, "depth": 3, "size": 16, "total_tokens": 16}  # total_tokens: the deprecated name, one more release
    # The plain mode prints the same tokens.
    proc = run_node(node, "--coordinator", pipeline, *args, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == expected


@pytest.mark.slow
def test_node_text_matches_python_client(node, pipeline, tiny_models):
    """Node sends text and prints the coordinator's text deltas; the Python client tokenizes and
    decodes locally (--target supplies its tokenizer): same tokens, same text."""
    args = ["--prompt", "t1 t5 t9 t33", "--max-new-tokens", "20", "--ignore-eos"]
    expected = python_generate(pipeline, "--target", str(tiny_models[0]), *args)  # applies the chat template
    assert len(expected["tokens"]) == 20 and expected["text"]
    args.append("--chat")  # Node: the chat template on the coordinator
    proc = run_node(node, "--coordinator", pipeline, *args, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == expected["tokens"] and out["text"] == expected["text"]
    proc = run_node(node, "--coordinator", pipeline, *args, timeout=300)  # streamed to stdout as text
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected["text"] + "\n"


@pytest.mark.slow
def test_node_http_chat_matches_the_openai_python_client(node, pipeline):
    """clients/node/chat.js (fetch + server-sent events) against the HTTP API that `aerie up` started:
    the same text as the official openai Python client."""
    import openai

    assert HTTP_URL, "aerie up printed no http line"
    url = HTTP_URL[-1]
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    expected = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "t7 t8"}],
                                              max_tokens=16, temperature=0)
    proc = subprocess.run([node, str(CLIENT_DIR / "chat.js"), "--url", url, "--prompt", "t7 t8", "--max-tokens", "16",
                           "--temperature", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] == expected.choices[0].message.content and out["text"]
    assert out["finish_reason"] == expected.choices[0].finish_reason
    assert out["usage"] == expected.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
