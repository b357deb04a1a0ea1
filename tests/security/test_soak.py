"""Soak (issue 15): `aerie up` as real processes (Redis, verifier, drafter, coordinator) on the tiny
test models; 20 concurrent clients for AERIE_SOAK_S seconds (default 60: ~2 minutes in all; set it
higher for a longer soak) mixing valid requests (greedy and seeded sampling), bad ones, cancels,
clients that walk away mid-stream and clients that are SIGKILLed mid-stream. Afterwards:

- every valid request's output equals its undisturbed output (taken before the load, one at a time);
- every bad request got INVALID_ARGUMENT and no neighbour failed;
- no sequence stays RUNNING in Redis, and the verifier and drafter hold no sequence (their GetInfo);
- the RSS of every service and Redis's used_memory are back within a set margin of their baseline
  (taken after a concurrent warm-up, once the warm-up's records expired: AERIE_FINISHED_TTL_S=3).

The RSS margin is coarse on purpose (allocator arenas and thread stacks of 20 clients); the exact leak
checks are the sequence counts. Numbers are printed (pytest -s)."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis

from services.rpc.channel import open_channel
from services.rpc.security import Security
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc, drafter_grpc, verifier_grpc
from tests.pipeline import TREE

SOAK_S = float(os.environ.get("AERIE_SOAK_S", "60"))
CLIENTS = 20
RSS_MARGIN = (0.10, 24 << 20)  # back within 10 % or 24 MiB of the baseline, whichever is larger
REDIS_MARGIN = 1 << 20  # used_memory back within 1 MiB of its baseline
ROOT = Path(__file__).resolve().parents[2]
INTERNAL = "soak-internal-token-0123456789"  # aerie up's internal token (it generates one when unset)

VALID = {
    "greedy-a": dict(prompt_ids=[5, 17, 99, 3, 42], max_new_tokens=16),
    "greedy-b": dict(prompt_ids=[7, 7, 8, 1], max_new_tokens=24, ignore_eos=True),
    "greedy-c": dict(prompt_ids=list(range(1, 30)), max_new_tokens=12),
    "stop-id": dict(prompt_ids=[9, 10, 11], max_new_tokens=20, stop_token_ids=[40, 41, 42]),
    "seeded-a": dict(prompt_ids=[5, 17, 99], max_new_tokens=16, ignore_eos=True,
                     sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, seed=11)),
    "seeded-b": dict(prompt_ids=[2, 4, 6, 8], max_new_tokens=20,
                     sampling=pb.SamplingParams(temperature=1.0, top_k=20, seed=12345)),
}
BAD = [
    dict(prompt_ids=[1, 999], max_new_tokens=4),
    dict(prompt_ids=[1, 2], sampling=pb.SamplingParams(temperature=1.0, top_p=2.0)),
    dict(prompt_ids=[1, 2], stop_token_ids=list(range(65))),
    dict(prompt_ids=[1, 2], max_new_tokens=5000),
    dict(prompt_ids=[1, 2], sequence_id="not a valid id!"),
    dict(prompt_ids=[]),
]
GARBAGE = b"\xff\xff\xff\xff\x0f"
KILLED_CLIENT = """
import os, signal, sys
from services.rpc.channel import open_channel
from services.rpc.security import Security
from services.rpc.stubs import coordinator as cpb, coordinator_grpc
stub = coordinator_grpc.CoordinatorStub(open_channel(sys.argv[1], 4 << 20))
call = stub.Generate(cpb.GenerateRequest(prompt_ids=[5, 17, 99, 3], max_new_tokens=300, ignore_eos=True), timeout=60)
next(call)
os.kill(os.getpid(), signal.SIGKILL)
"""


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def sequence_records(r: redis.Redis) -> dict[str, str]:
    """sequence key -> status, for every sequence record in Redis."""
    out = {}
    for key in r.scan_iter("aerie:seq:*", count=1000):
        if not key.endswith(":tokens"):
            status = r.hget(key, "status")
            if status is not None:
                out[key] = status
    return out


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def up(model_dirs, tmp_path):
    env = {**os.environ, "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING", "AERIE_FINISHED_TTL_S": "3",
           "AERIE_INTERNAL_TOKEN": INTERNAL}
    state = tmp_path / "state.json"
    argv = ["--target", str(model_dirs.target), "--draft", str(model_dirs.head), "--dtype", "fp32",
            "--tree-top-k", str(TREE.top_k), "--tree-depth", str(TREE.depth), "--tree-tokens", str(TREE.size),
            "--draft-dtype", "fp32", "--port", "0", "--http-port", "0", "--state-file", str(state)]
    proc = subprocess.Popen([sys.executable, "-m", "aerie_cli", "up", *argv], stdout=subprocess.PIPE, text=True,
                            env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not (lines and lines[-1].startswith("ready:")):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"aerie up exited with {proc.poll()}: {lines}"
            assert time.monotonic() < deadline, lines
            lines.append(line.strip())
        password = Path(re.search(r"password in (\S+), mode 0600", "\n".join(lines)).group(1)).read_text().strip()
        processes = {p["role"]: p for p in json.loads(state.read_text())["processes"]}
        yield processes, password
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def generate(stub, kw: dict) -> tuple[list[int], str]:
    tokens, reason = [], ""
    for m in stub.Generate(cpb.GenerateRequest(**kw), timeout=120):
        tokens += m.tokens
        reason = m.finish_reason or reason
    return tokens, reason


@pytest.mark.slow
def test_soak(up):
    processes, password = up
    address = processes["coordinator"]["address"]
    r = redis.Redis.from_url(f"redis://:{password}@{processes['redis']['address']}/0", decode_responses=True)
    channel = open_channel(address, 4 << 20)
    stub = coordinator_grpc.CoordinatorStub(channel)
    internal = Security(internal_token=INTERNAL)  # what aerie up's coordinators send
    verifier = verifier_grpc.VerifierStub(open_channel(processes["verifier"]["address"], 4 << 20, internal))
    drafter = drafter_grpc.DrafterStub(open_channel(processes["drafter"]["address"], 4 << 20, internal))
    # nobody but the coordinators may call them (the "Release another client's sequence")
    anyone = verifier_grpc.VerifierStub(open_channel(processes["verifier"]["address"], 4 << 20))
    with pytest.raises(grpc.RpcError) as e:
        anyone.Release(pb.ReleaseRequest(sequence_id="someone-elses"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    undisturbed = {name: generate(stub, kw) for name, kw in VALID.items()}  # one at a time, nothing else running

    def warm(i: int) -> None:
        name = list(VALID)[i % len(VALID)]
        assert generate(stub, VALID[name]) == undisturbed[name]

    warmers = [threading.Thread(target=warm, args=(i,)) for i in range(CLIENTS)]
    for t in warmers:
        t.start()
    for t in warmers:
        t.join(300)
    wait_for(lambda: not sequence_records(r), 60, "the warm-up's records to expire")
    baseline = {role: rss(p["pid"]) for role, p in processes.items()}
    redis_base = r.info("memory")["used_memory"]

    deadline = time.monotonic() + SOAK_S
    counts = {k: 0 for k in ("valid", "bad", "cancel", "walk-away", "killed")}
    problems: list[str] = []
    lock = threading.Lock()

    def note(kind: str, problem: str | None = None) -> None:
        with lock:
            counts[kind] += 1
            if problem:
                problems.append(f"{kind}: {problem}")

    def client(i: int) -> None:
        rng = random.Random(i)
        ch = open_channel(address, 4 << 20)
        s = coordinator_grpc.CoordinatorStub(ch)
        try:
            while time.monotonic() < deadline:
                roll = rng.random()
                try:
                    if roll < 0.5:
                        name = rng.choice(list(VALID))
                        got = generate(s, VALID[name])
                        note("valid", None if got == undisturbed[name] else f"{name}: {got} != {undisturbed[name]}")
                    elif roll < 0.7:
                        if rng.random() < 0.2:
                            call = ch.unary_stream("/aerie.v1.Coordinator/Generate", request_serializer=None,
                                                   response_deserializer=None)
                            bad = lambda: list(call(GARBAGE, timeout=30))  # noqa: E731
                        else:
                            kw = rng.choice(BAD)
                            bad = lambda: generate(s, kw)  # noqa: E731
                        try:
                            bad()
                            note("bad", "a bad request was accepted")
                        except grpc.RpcError as e:
                            note("bad", None if e.code() == grpc.StatusCode.INVALID_ARGUMENT else str(e.code()))
                    elif roll < 0.9:
                        call = s.Generate(cpb.GenerateRequest(prompt_ids=[3, 1, 4, 1, 5], max_new_tokens=200,
                                                              ignore_eos=True), timeout=120)
                        seq_id = next(call).sequence_id
                        s.Cancel(cpb.CancelRequest(sequence_id=seq_id), timeout=30)
                        reasons = [m.finish_reason for m in call if m.finish_reason]
                        note("cancel", None if reasons in (["cancel"], ["length"]) else f"finish {reasons}")
                    else:
                        call = s.Generate(cpb.GenerateRequest(prompt_ids=[2, 7, 1, 8], max_new_tokens=200,
                                                              ignore_eos=True), timeout=120)
                        next(call)
                        call.cancel()  # the client walks away mid-stream
                        note("walk-away")
                except grpc.RpcError as e:
                    note("valid", f"a neighbour failed: {e.code()} {e.details()}")
        finally:
            ch.close()

    def killer() -> None:
        while time.monotonic() < deadline:
            p = subprocess.run([sys.executable, "-c", KILLED_CLIENT, address], cwd=ROOT, capture_output=True,
                               timeout=120)
            note("killed", None if p.returncode == -signal.SIGKILL else f"exit {p.returncode}: {p.stderr[-300:]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)] + [threading.Thread(target=killer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_S + 300)
    print(f"\nsoak {SOAK_S:.0f} s, {CLIENTS} clients: {counts}")
    assert not problems, problems[:10]
    assert counts["valid"] > 0 and counts["bad"] > 0 and counts["cancel"] > 0 and counts["killed"] > 0

    # nothing stays RUNNING, nothing stays allocated, the records expire
    wait_for(lambda: "running" not in sequence_records(r).values(), 60, "every sequence to end")
    wait_for(lambda: verifier.GetInfo(pb.InfoRequest(), timeout=10).num_sequences == 0, 60, "the verifier's KV")
    wait_for(lambda: drafter.GetInfo(pb.InfoRequest(), timeout=10).num_sequences == 0, 60, "the drafter's KV")
    wait_for(lambda: not sequence_records(r), 60, "the finished records to expire")
    after = {role: rss(p["pid"]) for role, p in processes.items()}
    redis_after = r.info("memory")["used_memory"]
    for role in baseline:
        print(f"{role:<12} RSS {baseline[role] / 2**20:7.1f} MiB -> {after[role] / 2**20:7.1f} MiB")
    print(f"redis        used_memory {redis_base / 2**20:.2f} MiB -> {redis_after / 2**20:.2f} MiB")
    for role in baseline:
        allowed = baseline[role] + max(RSS_MARGIN[0] * baseline[role], RSS_MARGIN[1])
        assert after[role] <= allowed, (role, baseline[role], after[role])
    assert redis_after <= redis_base + REDIS_MARGIN, (redis_base, redis_after)
