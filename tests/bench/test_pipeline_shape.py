"""`aerie bench --shape S --pipeline` (services/bench/pipeline_shape.py) end to end on the CPU with the
tiny shape: a random checkpoint written to disk, the in-process engine on it, then four real `aerie up`
pipelines (separate processes, gRPC, Redis; one with --colocate, one with --direct-drafts) on it; the JSON the docs read (no speed
asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from services.bench.pipeline_shape import table

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_shape_bench_streams_the_in_process_tokens_through_aerie_up(tmp_path):
    out = tmp_path / "pipeline.json"
    proc = subprocess.run([sys.executable, "-m", "aerie_cli", "bench", "--shape", "tiny", "--device", "cpu",
                           "--pipeline", "--max-new-tokens", "6", "--prompt-tokens", "16", "--repeats", "1",
                           "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny" and res["device"] == "cpu" and res["dtype"] == "fp32" and res["complete"]
    for side, labels in (("in_process", ("plain", "eagle")), ("pipeline", ("plain", "eagle", "colocated", "direct"))):
        for label in labels:
            r = res[side][label]
            assert r["ms_per_token"] > 0 and len(r["runs_ms_per_token"]) == 1, (side, label)
            assert len(r["token_ids"]) == 6, (side, label)  # ignore_eos: every token asked for
    for side, label in (("in_process", "eagle"), ("pipeline", "eagle"), ("pipeline", "colocated"), ("pipeline", "direct")):
        split = res[side][label]["round_ms"]  # tree rounds after the first: their stats' draft and verify
        assert split["draft"] > 0 and split["verify"] > 0 and split["wall"] > 0, (side, label)
        assert split["wall_mean"] > 0 and split["slow_extra"] >= 0, (side, label)
    # greedy through the services == in process (and plain == EAGLE: lossless), on the same checkpoint
    assert res["same_tokens"] == {"plain": True, "eagle": True, "colocated": True, "direct": True}
    assert res["in_process"]["plain"]["token_ids"] == res["in_process"]["eagle"]["token_ids"]
    assert min(res["ratio"].values()) > 0 and set(res["ratio"]) == {"plain", "eagle", "colocated", "direct"}
    printed = table(res)
    assert "same tokens" in printed and "TOKENS DIFFER" not in printed and printed in proc.stdout
    assert "EAGLE round pipeline: wall (draft + verify) ms" in printed
    assert "EAGLE round colocated: wall (draft + verify) ms" in printed
    assert "EAGLE round direct drafts: wall (draft + verify) ms" in printed


def test_a_failed_start_says_why(tmp_path, monkeypatch):
    """`aerie up` that exits before its ready line: the error carries its exit code and log tail."""
    from services.bench import pipeline_shape

    cfg = pipeline_shape.PipelineBenchConfig("tiny", "cpu", "fp32", startup_timeout_s=60)
    up = pipeline_shape.AerieUp(cfg, tmp_path / "no-such-target", "none", tmp_path / "up.log")
    try:
        with up:
            raise AssertionError("it became ready without a model")
    except RuntimeError as e:
        message = str(e)
    assert "did not become ready (exit code " in message
    assert "no-such-target" in message.split(":\n", 1)[1]  # the log's tail names what was missing


def test_pipelines_picks_the_pipelines_measured(tmp_path):
    """`--pipelines colocated,colocated-host --interleave` with AERIE_PAGED_KV=1 (the GPU's paths on the
    CPU): those pipelines alone, both up at once, the in-process sides as always; the colocated one's
    rounds were device rounds and colocated-host's (AERIE_DEVICE_ROUND=0 in its environment) were not,
    as their verifiers' /metrics say; `--profile` leaves each service's py-spy samples and their summary;
    an unknown name is refused naming it."""
    out = tmp_path / "pipeline.json"
    argv = [sys.executable, "-m", "aerie_cli", "bench", "--shape", "tiny", "--device", "cpu", "--pipeline",
            "--max-new-tokens", "16", "--prompt-tokens", "8", "--repeats", "1", "--json-out", str(out)]  # (runs: > 5 left)
    env = {**os.environ, "AERIE_PAGED_KV": "1", "AERIE_KV_BUDGET_MB": "64"}
    proc = subprocess.run([*argv, "--pipelines", "colocated,colocated-host", "--interleave",
                           "--profile", str(tmp_path / "profile")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["pipeline"]) == {"colocated", "colocated-host"} and res["interleave"]
    assert res["same_tokens"] == {"colocated": True, "colocated-host": True}
    assert all(len(res["pipeline"][label]["runs_ms_per_token"]) == 1 for label in res["pipeline"])
    assert "EAGLE, --colocate, AERIE_DEVICE_ROUND=0 (rounds on the host)" in table(res)
    assert "the pipelines up at once, their requests in turn" in table(res) and "(interleaved)" in proc.stdout
    assert res["pipeline"]["colocated-host"]["device_rounds"] == {"kept": 0.0, "dropped": 0.0}
    kept = res["pipeline"]["colocated"]["device_rounds"]["kept"]
    assert kept >= 2 and res["pipeline"]["colocated"]["device_rounds"]["dropped"] == 0
    assert f"device rounds kept {kept:.0f}, dropped 0" in table(res)
    # --profile: py-spy sampled each pipeline's verifier and coordinator while the requests ran; where
    # this machine lets no process read another's memory (ptrace), each role's entry says so instead
    attach = py_spy_attaches()
    for label in ("colocated", "colocated-host"):
        profile = res["pipeline"][label]["profile"]
        assert set(profile) == {"verifier", "coordinator"}, profile
        if not attach:
            assert all("py-spy wrote no samples" in p["error"] for p in profile.values()), profile
            continue
        batcher = profile["verifier"]["threads"]["verifier-batcher"]  # the model thread ran the forwards
        assert batcher["samples"] > 0 and profile["verifier"]["seconds"] > 0
        assert (tmp_path / "profile" / f"interleaved-{label}-verifier.raw").exists()
        assert (tmp_path / "profile" / f"interleaved-{label}-verifier-gil.raw").exists()
        assert f"profile {label}, verifier, " in table(res)
    bad = subprocess.run([*argv, "--pipelines", "colocated,nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--pipelines must name some of eagle, colocated, colocated-host" in bad.stderr
    assert "'colocated,nope'" in bad.stderr


def py_spy_attaches() -> bool:
    """Whether py-spy can read another process here (ptrace allowed: root, or a permissive
    ptrace_scope): `py-spy dump` of a sleeping Python child succeeds."""
    from services.bench.service_profile import find_py_spy

    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"  # (its interpreter is running)
        return subprocess.run([find_py_spy(), "dump", "--pid", str(child.pid)], capture_output=True,
                              timeout=60).returncode == 0
    finally:
        child.kill()
        child.wait()


def test_an_aerie_up_gets_its_pipeline_s_environment(tmp_path):
    """colocated-host's AERIE_DEVICE_ROUND=0 reaches the `aerie up` it starts (on top of this process's)."""
    from services.bench import pipeline_shape

    env = pipeline_shape.PIPELINES["colocated-host"][4]
    assert env == {"AERIE_DEVICE_ROUND": "0"}
    cfg = pipeline_shape.PipelineBenchConfig("tiny", "cpu", "fp32", startup_timeout_s=60)
    up = pipeline_shape.AerieUp(cfg, tmp_path / "no-such-target", "none", tmp_path / "up.log", env=env)
    up.argv = [sys.executable, "-c", "import os, sys; sys.stderr.write('device round ' + os.environ['AERIE_DEVICE_ROUND'])"]
    try:
        with up:
            raise AssertionError("ready without a ready line")
    except RuntimeError as e:
        assert "device round 0" in str(e)


def test_the_round_summary_says_what_the_median_leaves_out():
    """`summary` (services/bench/pipeline_shape.py): the median wall hides a run's first round and the
    single calls at a request's end; `wall_mean` and `slow_extra` show them (hand-made streams)."""
    from services.bench.pipeline_shape import Stream, summary

    # ten 10 ms rounds and two 20 ms ones (a run boundary, a last single call): 11.67 ms a round
    walls = [10.0] * 5 + [20.0] + [10.0] * 5 + [20.0]
    stream = Stream(seconds=sum(walls) / 1e3, decoded=len(walls), tokens=[1] * 13,
                    parts_ms=[(w, 1.0, 8.0) for w in walls], in_runs=9)
    single = Stream(stream.seconds, stream.decoded, stream.tokens, stream.parts_ms)  # no round from a run
    r = summary([stream, single])["round_ms"]
    assert r["wall"] == 10.0 and r["draft"] == 1.0 and r["verify"] == 8.0
    assert abs(r["wall_mean"] - 140 / 12) < 1e-9 and abs(r["slow_extra"] - 20 / 12) < 1e-9
    assert r["run_share"] == 9 / 24
