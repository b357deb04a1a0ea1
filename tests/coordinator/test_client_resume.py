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


@pytest.fixture(scope="module")
def coordinators(pipeline, redis_url, tmp_path_factory):
    """Three coordinator processes on the pipeline's verifier and drafter: {address: Popen}."""
    root = tmp_path_factory.mktemp("coordinators")
    env = {**os.environ, "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING"}
    procs = []
    for i in range(3):
        argv = [sys.executable, "-m", "aerie_cli", "coordinator", "--host", "127.0.0.1", "--port", "0",
                "--port-file", str(root / f"c{i}.json"), "--verifiers", pipeline.addresses["verifier"],
                "--drafters", pipeline.addresses["drafter"], "--redis-url", redis_url, "--discover", "0",
                "--lease-ttl-s", str(LEASE_TTL_S), "--drain-s", "0"]  # hand over at once: mid-stream
        procs.append((root / f"c{i}.json", subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)))
    out = {}
    try:
        deadline = time.monotonic() + 120
        for port_file, proc in procs:
            while not port_file.exists() or not port_file.read_text().strip():
                assert proc.poll() is None, f"a coordinator exited with {proc.returncode}"
                assert time.monotonic() < deadline, "a coordinator did not start in 120 s"
                time.sleep(0.05)
            out[f"127.0.0.1:{json.loads(port_file.read_text())['port']}"] = proc
        yield out
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def expected_tokens(model_dirs, req):
    return local_run(local_engine(model_dirs, draft_dtype="fp32"), req)[0]


def test_a_session_resumes_through_a_drain_and_a_kill(pipeline, coordinators, model_dirs):
    """SIGTERM of the coordinator the stream is on (it drains and hands the sequence over), then kill -9
    of the one it resumed on: one stream, exactly the undisturbed run's tokens."""
    req = GenerationRequest(PROMPT, NEW_TOKENS, SamplingParams(), ignore_eos=True)
    expected = expected_tokens(model_dirs, req)
    first, second, _ = coordinators
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
    _, _, third = coordinators
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


def test_an_in_process_drain_is_resumed_by_aerie_generate(pipeline, model_dirs, redis_url, capsys):
    """`aerie generate --coordinator A,B`: A drains mid-stream (the hand-over that SIGTERM runs, here
    called in process), the CLI prints the undisturbed tokens and a note on stderr."""
    draining, address = pipeline.add_coordinator(redis_url, lease_ttl_s=0.6)
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
