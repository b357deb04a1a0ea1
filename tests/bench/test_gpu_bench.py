"""The model-free device benchmark (`aerie bench --shape`, services/bench/gpu.py) end to end on the
CPU with the tiny shape: it runs every part and writes the JSON the docs read (no speed asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_shape_bench_runs_every_part_and_writes_json(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "aerie_cli", "bench", "--shape", "tiny", "--device", "cpu",
                           "--max-new-tokens", "4", "--batches", "1,2", "--prompt-tokens", "16", "--no-hf",
                           "--no-legacy", "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny" and res["device"] == "cpu" and res["dtype"] == "fp32"
    assert set(res["rounds"]) == {"60/5/10", "16/3/4", "chain 8/7/1"}
    assert all(r["round_ms"] > 0 and r["rounds"] >= 1 for r in res["rounds"].values())
    assert set(res["batched"]) == {"1", "2"} and res["batched"]["1"]["vs_n1"] == 1.0
    assert res["plain_ms"]["paged_eager"] > 0 and res["weight_gb"] > 0
    assert "plain decoding, paged_eager (ms/token)" in proc.stdout  # the table


def test_shape_bench_refuses_an_unknown_shape():
    proc = subprocess.run([sys.executable, "-m", "aerie_cli", "bench", "--shape", "gpt-5", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--shape must be one of llama-3.1-8b" in proc.stderr
