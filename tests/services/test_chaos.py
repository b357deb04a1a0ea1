"""Chaos: `aerie up --verifiers 2 --drafters 2 --coordinators 2` as real processes on loopback, 8
concurrent streams (greedy and seeded sampling) on the tiny test models, and mid-stream: kill -9 of
a drafter, then of a verifier, then of a coordinator (its clients resume on the other one), then of
Redis, then a SIGTERM of the coordinator that drives the streams now: after AERIE_DRAIN_S it hands
them over (each stream ends UNAVAILABLE naming the Resume index, which is exactly what it received)
and the clients resume on the other one. Every stream completes with exactly the tokens of the
undisturbed in-process run: nothing lost, nothing duplicated. The added latency per fault is printed (pytest -s) and written to
$AERIE_CHAOS_REPORT when set.

With drafting ahead on (`overlap`: AERIE_OVERLAP=always, DraftAhead overlapping every Verify: a
learning policy would decline with 8 streams on two drafters) the faults
land in overlapped rounds: the greedy streams still equal the undisturbed run token for token; the
seeded sampling streams complete with valid tokens but are not compared, because a fault changes
which trees are verified (an ahead draft that failed is replaced by a fresh draft; a take-over starts
a fresh overlap policy), and a sampled token depends on the tree it was drawn against (the
distribution does not: tests/engine/test_overlap.py).

With direct drafts (`direct`: AERIE_DIRECT_DRAFTS=1, the verifiers send each verdict's Draft to the
drafter themselves, in runs of tree rounds) the drafter's kill lands inside a run (the verifier's Draft
fails, the coordinator drafts and fails over) and every stream, sampled ones too, equals the
undisturbed run (the same Draft calls, sent from another place). Both together (`overlap+direct`,
what `aerie up --overlap on` runs by default): the rounds that draft ahead send a DraftAhead beside a
plain Verify, the others a direct draft; compared as `overlap`."""

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import grpc
import pytest

from services.engine.engine import GenerationRequest
from services.rpc.channel import open_channel
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import coordinator_grpc
from services.spec.sampling import SamplingParams
from tests.pipeline import TREE, local_engine, local_run

FAULTS = ("drafter", "verifier", "coordinator", "redis", "drain")  # drain: SIGTERM of a coordinator
NEW_TOKENS = 400  # long enough that four faults land mid-stream on a fast machine too
RETRY_S = 240  # how long a stream keeps resuming after UNAVAILABLE


def start_up(model_dirs, tmp_path, overlap: bool = False, direct: bool = False):
    env = {**os.environ, "AERIE_OVERLAP": "always" if overlap else "0", "AERIE_DIRECT_DRAFTS": "1" if direct else "0",
           "AERIE_TORCH_THREADS": "1", "AERIE_LOG_LEVEL": "WARNING", "AERIE_PROBE_INTERVAL_S": "0.5",
           "AERIE_HEARTBEAT_S": "0.5", "AERIE_HEARTBEAT_TTL_S": "2", "AERIE_LEASE_TTL_S": "2",
           # 0: the SIGTERM hands the streams over at once; with a drain window (0.5 s) a fast machine
           # could finish every stream inside it and hand none over (the handover assertion below)
           "AERIE_DRAIN_S": "0"}
    state = tmp_path / "state.json"
    argv = ["--target", str(model_dirs.target), "--draft", str(model_dirs.head), "--dtype", "fp32",
            "--tree-top-k", str(TREE.top_k), "--tree-depth", str(TREE.depth), "--tree-tokens", str(TREE.size),
            "--draft-dtype", "fp32", "--port", "0", "--http-port", "0", "--verifiers", "2", "--drafters", "2", "--coordinators", "2", "--state-file", str(state)]
    up = subprocess.Popen([sys.executable, "-m", "aerie_cli", "up", *argv], stdout=subprocess.PIPE, text=True,
                          env=env)
    deadline = time.monotonic() + 240
    lines = []
    while not (lines and lines[-1].startswith("ready:")):
        line = up.stdout.readline()
        assert line or up.poll() is None, f"aerie up exited with {up.poll()}: {lines}"
        assert time.monotonic() < deadline, lines
        lines.append(line.strip())
    return up, state


def processes(state, role):
    return [p for p in json.loads(state.read_text())["processes"] if p["role"] == role]


def scraped(process: dict, name: str, label: str = "") -> float:
    """The sum of a process's `name{...}` samples (with `label` among their labels) on its /metrics;
    0 for a process that is gone."""
    import urllib.request

    host = process["address"].rsplit(":", 1)[0]
    try:
        text = urllib.request.urlopen(f"http://{host}:{process['metrics_port']}/metrics", timeout=10).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def direct_drafts(process: dict) -> float:
    """A verifier process's direct drafts that drafted."""
    return scraped(process, "aerie_direct_drafts_total", 'outcome="drafted"')


def running(process: dict) -> float:
    """The sequences a coordinator process runs now."""
    return scraped(process, "aerie_sequences_in_flight", 'service="coordinator"')


class Stream:
    """One client stream; reconnects with Resume to another coordinator when its coordinator dies."""

    def __init__(self, req: GenerationRequest, coordinators: list[str]) -> None:
        self.req = req
        self.coordinators = coordinators
        self.tokens: list[int] = []
        self.times: list[float] = []  # arrival time of each message
        self.finish = ""
        self.sequence_id = ""
        self.resumes = 0
        self.handovers: list[tuple[int, int]] = []  # a draining coordinator's end: (Resume index it named, received)
        self.error = None
        self.unavailable: list[str] = []  # every UNAVAILABLE this stream retried (for the failure message)
        self.attached = ""  # the coordinator whose call it reads now ("": none)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s = self.req.sampling
        attempt, backoff = 0, 0.2
        # a client retries UNAVAILABLE with backoff for as long as a Redis restart or a take-over may
        # take on a loaded machine (not a fixed count: 10 quick retries can all land inside one restart)
        give_up = time.monotonic() + RETRY_S
        while not self.finish and time.monotonic() < give_up:
            address = self.coordinators[attempt % len(self.coordinators)]
            channel = open_channel(address, 4 * 1024 * 1024)
            stub = coordinator_grpc.CoordinatorStub(channel)
            self.attached = address
            try:
                if not self.sequence_id:
                    call = stub.Generate(cpb.GenerateRequest(
                        prompt_ids=list(self.req.prompt_ids), max_new_tokens=self.req.max_new_tokens, ignore_eos=True,
                        sampling=pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                   seed=s.seed)), timeout=RETRY_S)
                else:
                    self.resumes += 1
                    call = stub.Resume(cpb.ResumeRequest(sequence_id=self.sequence_id,
                                                         from_token_index=len(self.tokens)), timeout=RETRY_S)
                for msg in call:
                    self.sequence_id = msg.sequence_id or self.sequence_id
                    self.tokens += msg.tokens
                    self.times.append(time.monotonic())
                    self.finish = msg.finish_reason
            except grpc.RpcError as e:
                if "coordinator draining" in (e.details() or ""):
                    self.handovers.append((int(dict(e.trailing_metadata() or ())["aerie-resume-from"]), len(self.tokens)))
                if not self.sequence_id or e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.error = e
                    return
                self.unavailable.append(f"{time.monotonic():.1f}: {e.details()}")
                attempt += 1
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
            finally:
                self.attached = ""
                channel.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serial", "overlap", "direct", "overlap+direct"])
def test_chaos_every_stream_completes_with_the_undisturbed_tokens(model_dirs, tmp_path, mode):
    overlap = mode.startswith("overlap")
    reqs = [GenerationRequest((5 + i, 17, 99, 3, 42, 8 + i), NEW_TOKENS,
                              SamplingParams() if i % 2 == 0 else SamplingParams(0.8, 0.95, 0, 100 + i),
                              ignore_eos=True) for i in range(8)]
    reference = local_engine(model_dirs, draft_dtype="fp32")  # fp32 drafts: see test_failover.DRAFT_DTYPE
    expected = [local_run(reference, r)[0] for r in reqs]
    up, state = start_up(model_dirs, tmp_path, overlap, direct=mode.endswith("direct"))
    report = {}
    try:
        coordinators = [p["address"] for p in processes(state, "coordinator")]
        streams = [Stream(r, coordinators[:1] + coordinators[1:]) for r in reqs]
        for s in streams:
            s.thread.start()
        total = NEW_TOKENS * len(reqs)
        for k, role in enumerate(FAULTS):
            # each fault when the streams are ~(k+1)/6 of the way through
            while sum(len(s.tokens) for s in streams) < total * (k + 1) / 6:
                assert any(s.thread.is_alive() for s in streams), "the streams ended before the faults"
                time.sleep(0.01)
            # the drain hits the coordinator that serves the most client streams now, then the one that runs
            # the most sequences (after Redis's kill, whose leases lapse meanwhile, a coordinator may run
            # sequences whose client streams read from the other one: draining it hands no stream over)
            victim = (max(processes(state, "coordinator"),
                          key=lambda p: (sum(s.attached == p["address"] for s in streams), running(p)))
                      if role == "drain" else processes(state, role)[0])
            t_kill = time.monotonic()
            os.kill(victim["pid"], signal.SIGTERM if role == "drain" else signal.SIGKILL)
            report[role] = {"t": t_kill}
            time.sleep(0.3)
        for s in streams:
            s.thread.join(RETRY_S + 60)
        for i, s in enumerate(streams):
            assert s.error is None, f"stream {i}: {s.error}"
            assert s.finish == "length", (f"stream {i} did not finish: {len(s.tokens)} tokens, thread alive "
                                          f"{s.thread.is_alive()}, {s.resumes} resumes, retried {s.unavailable}")
            if overlap and not reqs[i].sampling.greedy:  # see the module doc
                assert len(s.tokens) == NEW_TOKENS and all(0 <= t < reference.vocab_size for t in s.tokens)
                continue
            assert s.tokens == expected[i], f"stream {i} differs from the undisturbed run"
        assert sum(s.resumes for s in streams) >= 1  # the coordinator kill really cut streams
        if mode == "direct":  # the verifiers sent drafts to the drafters themselves
            assert sum(direct_drafts(v) for v in processes(state, "verifier")) > 0
        handovers = [h for s in streams for h in s.handovers]
        assert handovers, "the SIGTERM handed no stream over"
        assert all(named == received for named, received in handovers), handovers  # nothing held back
        # added latency: after each kill, the longest wait of any stream for its next message,
        # minus the median message interval
        gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
        median = statistics.median(gaps)
        for role, r in report.items():
            waits = [min((t for t in s.times if t > r["t"]), default=r["t"]) - r["t"] for s in streams]
            r["next_message_s"] = round(max(waits), 3)
            r["added_s"] = round(max(waits) - median, 3)
            del r["t"]
        report["median_message_interval_s"] = round(median, 4)
        print("chaos report:", json.dumps(report))
        if os.environ.get("AERIE_CHAOS_REPORT"):
            with open(os.environ["AERIE_CHAOS_REPORT"], "w") as f:
                json.dump(report, f, indent=1)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
