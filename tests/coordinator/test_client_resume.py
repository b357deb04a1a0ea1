"""The Python client (`aerie generate --coordinator`, services/rpc/coordinator_client.py) Resumes by
itself. Coordinators run as real processes (`python -m aerie_cli coordinator`) on an in-process
verifier and drafter (tests/pipeline.py), with a real Redis; faults are real signals: SIGTERM (the
coordinator hands its sequences over after AERIE_DRAIN_S, here 0) and kill -9. A session given
several addresses yields exactly the undisturbed run's tokens through both faults; with resume_s=0
the same fault raises RemoteError UNAVAILABLE, as before; a bad address list is refused by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from aerie_cli.main import main
from services.engine.engine import GenerationRequest
from services.errors import InvalidRequest
from services.rpc.coordinator_client import RESUME_S, RemoteError, RemoteSession, parse_addresses
from services.spec.sampling import SamplingParams
from tests.pipeline import local_engine, local_run, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)
NEW_TOKENS = 400  # long enough that two faults land mid-stream (the tiny model's context is 512)
LEASE_TTL_S = 1.0


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, lease_ttl_s=0.6, draft_dtype="fp32")  # see test_failover.DRAFT_DTYPE
    yield p
    p.close()


class Coordinators:
    """Coordinator processes on the pipeline's verifier and drafter, by address."""

    def __init__(self, pipeline, redis_url: str, root) -> None:
        self.pipeline, self.redis_url, self.root = pipeline, redis_url, root
        self.procs: dict[str, subprocess.Popen] = {}
        self._n = 0

    def start(self, count: int, port: int = 0) -> list[str]:
        """Start `count` processes (in parallel) and wait until they serve; their addresses."""
        env = {**os.environ, "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING"}
        started = []
        for _ in range(count):
            port_file = self.root / f"c{self._n}.json"
            self._n += 1
            argv = [sys.executable, "-m", "aerie_cli", "coordinator", "--host", "127.0.0.1", "--port", str(port),
                    "--port-file", str(port_file), "--verifiers", self.pipeline.addresses["verifier"],
                    "--drafters", self.pipeline.addresses["drafter"], "--redis-url", self.redis_url,
                    "--discover", "0", "--lease-ttl-s", str(LEASE_TTL_S),
                    "--drain-s", "0"]  # SIGTERM hands over at once: mid-stream
            started.append((port_file, subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)))
        deadline = time.monotonic() + 120
        addresses = []
        for port_file, proc in started:
            while not port_file.exists():
                assert proc.poll() is None, f"a coordinator exited with {proc.returncode}"
                assert time.monotonic() < deadline, "a coordinator did not start in 120 s"
                time.sleep(0.05)
            address = f"127.0.0.1:{json.loads(port_file.read_text())['port']}"
            self.procs[address] = proc
            addresses.append(address)
        return addresses

    def __getitem__(self, address: str) -> subprocess.Popen:
        return self.procs[address]

    def __contains__(self, address: str) -> bool:
        return address in self.procs

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def coordinators(pipeline, redis_url, tmp_path_factory):
    c = Coordinators(pipeline, redis_url, tmp_path_factory.mktemp("coordinators"))
    try:
        c.start(4)
        yield c
    finally:
        c.close()


def expected_tokens(model_dirs, req):
    return local_run(local_engine(model_dirs, draft_dtype="fp32"), req)[0]


def test_a_session_resumes_through_a_drain_and_a_kill(pipeline, coordinators, model_dirs):
    """SIGTERM of the coordinator the stream is on (it drains and hands the sequence over), then kill -9
    of the one it resumed on: one stream, exactly the undisturbed run's tokens."""
    req = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)
    expected = expected_tokens(model_dirs, req)
    first, second = list(coordinators.procs)[:2]
    # the in-process coordinator last: it is the one left after the two faults
    session = RemoteSession([first, second, pipeline.addresses["coordinator"]], None, "", timeout_s=120)
    got, reason, faults = [], None, []
    for step in session.engine.generate(req):
        got += step.tokens
        reason = step.finish_reason
        if not faults and len(got) >= 20:
            faults.append(("drain", session.address, len(got)))
            coordinators[session.address].send_signal(signal.SIGTERM)
        elif len(faults) == 1 and session.resumes == 1 and len(got) >= session.resumed_at[0][1] + 20:
            assert session.address in coordinators, session.address  # a process, so it can be killed
            faults.append(("kill", session.address, len(got)))
            coordinators[session.address].kill()
    print("faults (kind, address, tokens received):", faults, "resumed at:", session.resumed_at)
    assert [f[:2] for f in faults] == [("drain", first), ("kill", second)], faults
    assert reason == "length" and len(got) == NEW_TOKENS
    assert got == expected  # no gap, no duplicate
    assert session.resumes == 2 and [a for a, _ in session.resumed_at] == [second, pipeline.addresses["coordinator"]]
    # the drain named the Resume index, and it is what the client had received
    assert "coordinator draining" in session.breaks[0], session.breaks
    assert f"from_token_index={session.resumed_at[0][1]}" in session.breaks[0], (session.breaks, session.resumed_at)
    assert session.resumed_at[1][1] >= faults[1][2]
    assert coordinators[first].wait(30) == 0  # the drain ended the process cleanly
    session.close()


def test_without_resume_the_same_fault_fails_the_stream(pipeline, coordinators, model_dirs):
    """resume_s=0: the old behaviour, the stream's UNAVAILABLE reaches the caller (kill -9)."""
    third = list(coordinators.procs)[2]
    session = RemoteSession(f"{third},{pipeline.addresses['coordinator']}", None, "", timeout_s=120, resume_s=0)
    req = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)
    got = []
    with pytest.raises(RemoteError) as e:
        for step in session.engine.generate(req):
            got += step.tokens
            if len(got) >= 10 and coordinators[third].poll() is None:
                coordinators[third].kill()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and session.resumes == 0 and session.resume_tries == 0
    assert 10 <= len(got) < NEW_TOKENS
    seq_id = session.sequence_id
    session.close()
    # the sequence itself goes on (the in-process coordinator takes it over): cancel it there
    other = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=60)
    wait_until(lambda: pipeline.coordinator.store.get(seq_id).owner == pipeline.coordinator.sequences.owner
               or pipeline.coordinator.store.get(seq_id).status != "running", 30)
    other.cancel(seq_id)
    other.close()


def test_one_address_is_retried_until_a_new_coordinator_serves_there(pipeline, coordinators, model_dirs):
    """One address (a Kubernetes Service, or a pod replaced at the same address): kill -9 of the
    coordinator there, a new one starts on the same port some seconds later; the stream resumes there."""
    address = list(coordinators.procs)[3]
    req = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)
    expected = expected_tokens(model_dirs, req)
    session = RemoteSession(address, None, "", timeout_s=120)
    got, restarted, restart = [], [], None
    for step in session.engine.generate(req):  # the client retries while the new process starts
        got += step.tokens
        if len(got) >= 10 and restart is None:
            coordinators[address].kill()
            coordinators[address].wait(30)
            restart = threading.Thread(target=lambda: restarted.extend(
                coordinators.start(1, port=int(address.rsplit(":", 1)[1]))))
            restart.start()
    restart.join(120)
    assert restarted == [address]
    assert got == expected
    assert session.resumes == 1 and session.resumed_at[0][0] == address and session.resume_tries > 1
    session.close()


def test_an_in_process_drain_is_resumed_by_aerie_generate(pipeline, model_dirs, redis_url, capsys):
    """`aerie generate --coordinator A,B`: A drains mid-stream (the hand-over that SIGTERM runs, here
    called in process), the CLI prints the undisturbed tokens and a note on stderr."""
    # a 30 s lease: a live stream is never taken over because a loaded machine delayed a renewal, and
    # the hand-over (not an expiry) is what lets the other coordinator claim it
    draining, address = pipeline.add_coordinator(redis_url, lease_ttl_s=30.0)
    req = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)
    expected = expected_tokens(model_dirs, req)
    store = pipeline.coordinator.store
    handed = []

    def drain_mid_stream():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = draining.sequences.runs()
            if runs and len(store.get(runs[0].seq_id).tokens) >= 10:
                handed.append(draining.sequences.hand_over_all(0.0, 30.0))
                return
            time.sleep(0.005)

    thread = threading.Thread(target=drain_mid_stream)
    thread.start()
    code = main(["generate", "--coordinator", f"{address},{pipeline.addresses['coordinator']}",
                 "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
                 "--json"])
    thread.join(60)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert handed == [1], "the drain did not happen mid-stream"
    assert json.loads(out)["tokens"] == expected
    assert "resumed 1x (at token " in err and f"on {pipeline.addresses['coordinator']})" in err, err


BAD_ADDRESSES = [
    ("", "--coordinator '' is empty"),
    (" , ", "--coordinator ' , ' is empty"),
    ("a:1,,b:2", "entry '' is an empty entry"),
    ("a:1,b", "entry 'b' is not HOST:PORT"),
    ("a:1,:2", "entry ':2' is not HOST:PORT"),
    ("a:x", "entry 'a:x' is port 'x' is not a number in [1, 65535]"),
    ("a:70000", "port '70000' is not a number in [1, 65535]"),
    ("::1:5", "an IPv6 host goes in brackets"),
]


@pytest.mark.parametrize("value,message", BAD_ADDRESSES, ids=[v or "empty" for v, _ in BAD_ADDRESSES])
def test_a_bad_address_list_is_refused_by_name(value, message):
    with pytest.raises(InvalidRequest) as e:
        RemoteSession(value, None, "", timeout_s=10)
    assert message in str(e.value) and repr(value) in str(e.value), str(e.value)


def test_good_address_lists():
    assert parse_addresses("a:1, b:2") == ("a:1", "b:2")
    assert parse_addresses("[::1]:50051") == ("[::1]:50051",)
    assert parse_addresses(["svc.ns:50051"]) == ("svc.ns:50051",)


@pytest.mark.parametrize("argv,message", [
    (["--coordinator", "127.0.0.1:1,x"], "--coordinator '127.0.0.1:1,x': entry 'x' is not HOST:PORT"),
    (["--coordinator", "127.0.0.1:1", "--resume-s", "-1"], "--resume-s must be >= 0 (0 = never resume); got -1"),
])
def test_the_cli_refuses_bad_values_in_one_line(argv, message, capsys):
    code = main(["generate", *argv, "--prompt-ids", "1"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_the_cli_default_is_the_clients():
    from aerie_cli.generate import RESUME_S as CLI_RESUME_S

    assert CLI_RESUME_S == RESUME_S
