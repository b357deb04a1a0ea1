"""The model-free device benchmark (`aerie bench --shape`, services/bench/gpu.py) end to end on the
CPU with the tiny shape: it runs every part and writes the JSON the docs read (no speed asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench import gpu
from services.bench.gpu import TREES
from tests.helpers import require_triton

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
    assert res["complete"] is True
    # the CPU's eager drafter: trees on the host (no host_trees measurement beside them)
    assert all(r["device_trees"] is False and r["without"] == {} for r in res["rounds"].values())
    parts = res["rounds"]["60/5/10"]["draft_parts_ms"]  # the CPU's drafter: eager extension and expansion
    assert set(parts) == {"extension, eager", "expansion, eager", "re-rank and tree (host)", gpu.DRAFT_CALL}
    assert all(ms > 0 for ms in parts.values())
    # the parts' calls lie inside the drafter calls (timed by the same wrappers): never more than them
    assert sum(ms for p, ms in parts.items() if p != gpu.DRAFT_CALL) <= parts[gpu.DRAFT_CALL]
    assert res["draft_vocab"] == 64  # a quarter of the tiny vocabulary (32000 on the Llama shapes)
    assert set(res["rounds_draft_vocab"]) == {f"{t} {h} vocab 64" for t in ("60/5/10", "chain 8/7/1")
                                              for h in ("EAGLE-2", "EAGLE-3")}
    assert all(r["round_ms"] > 0 and r["rounds"] >= 1 for r in res["rounds_draft_vocab"].values())
    assert set(res["batched"]) == {"1", "2"} and res["batched"]["1"]["vs_n1"] == 1.0
    assert res["plain_ms"]["paged_eager"] > 0 and res["weight_gb"] > 0
    assert res["plain_ms"]["paged_eager_run"] > 0 and res["first_token_ms"] > 0
    assert "time to first token, the prompt's prefill (ms)" in proc.stdout
    assert "plain decoding, paged_eager (ms/token)" in proc.stdout  # the table
    assert "round 60/5/10 EAGLE-3 vocab 64" in proc.stdout
    assert res["paged_attention"] == {"status": "skipped: not a CUDA device (--paged-attention on tries it)"}


def test_shape_bench_measures_the_paged_kernel_next_to_the_default(tmp_path):
    """--paged-attention on, in Triton's interpreter on the CPU: plain decoding, the three rounds
    and batched decode again with AERIE_ATTENTION=paged, in the JSON and the table."""
    require_triton()
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "aerie_cli", "bench", "--shape", "tiny", "--device", "cpu",
                           "--max-new-tokens", "2", "--batches", "1,2", "--prompt-tokens", "8", "--no-hf",
                           "--no-legacy", "--paged-attention", "on", "--json-out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr
    paged = json.loads(out.read_text())["paged_attention"]
    assert paged["status"] == "ok" and paged["plain_ms"] > 0
    assert set(paged["rounds"]) == set(TREES) and all(r["verify_ms"] > 0 for r in paged["rounds"].values())
    assert set(paged["batched"]) == {"1", "2"} and paged["batched"]["1"]["vs_n1"] == 1.0
    assert "AERIE_ATTENTION=paged (Triton kernel)" in proc.stdout and "plain decoding (ms/token): paged vs default" \
        in proc.stdout


def test_a_failing_paged_measurement_is_reported_not_raised(monkeypatch):
    """The paged section's failure is its result (status + traceback); off skips."""
    require_triton()

    def broken(target, rows):
        raise RuntimeError("no arena today")

    monkeypatch.setattr(gpu, "_paged", broken)
    cfg = gpu.GpuBenchConfig("tiny", "cpu", "fp32", paged="on")
    lines: list[str] = []
    out = gpu._paged_attention(cfg, None, None, (1, 2), 64, lines.append)
    assert out["status"] == "failed: RuntimeError: no arena today" and "no arena today" in out["traceback"]
    assert lines[-1] == "paged attention: failed: RuntimeError: no arena today"
    assert gpu._paged_attention(gpu.GpuBenchConfig(paged="off"), None, None, (), 0, print)["status"].startswith(
        "skipped: --paged-attention off")
    with pytest.raises(ValueError, match="paged must be one of auto, on, off; got 'yes'"):
        gpu.GpuBenchConfig(paged="yes")


def test_shape_bench_refuses_an_unknown_shape():
    proc = subprocess.run([sys.executable, "-m", "aerie_cli", "bench", "--shape", "gpt-5", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--shape must be one of llama-3.1-8b" in proc.stderr


def test_round_floor_counts_the_target_once_and_the_head_per_level():
    """The round's bandwidth floor on the Llama-3.1-8B shape (meta tensors: shapes only): the
    target's 15.0 GB once, the head's layer (0.50 GB) and the full 128k-row projection (1.05 GB)
    1 + depth times -- 1.62 plain floors for depth 5, 1.31 with a 32k draft vocabulary."""
    import torch

    from services.bench import gpu
    from services.model.config import ModelConfig
    from services.model.eagle_head import HeadConfig, build_head
    from services.model.target import TargetModel

    cfg = ModelConfig.from_hf_dict(gpu.hf_config("llama-3.1-8b").to_dict() | {"architectures": ["LlamaForCausalLM"]})
    with torch.device("meta"):
        target = TargetModel(cfg).to(torch.bfloat16)
        c = target.config
        args = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.rms_norm_eps, c.vocab_size)
        eagle2 = build_head(HeadConfig("eagle", *args), target.lm_head).to(torch.bfloat16)
        eagle3 = build_head(HeadConfig("eagle3", *args, draft_vocab_size=32000)).to(torch.bfloat16)
    wb = gpu.weight_bytes(target)
    assert round(wb / 1e9, 2) == 15.01
    layer, proj = gpu.head_bytes(eagle2)
    assert (round(layer / 1e9, 3), round(proj / 1e9, 3)) == (0.503, 1.051)
    assert round(gpu.round_floor_bytes(wb, eagle2, 5) / wb, 2) == 1.62
    assert round(gpu.round_floor_bytes(wb, eagle2, 7) / wb, 2) == 1.83
    assert gpu.head_bytes(eagle3)[1] == 32000 * 4096 * 2
    assert round(gpu.round_floor_bytes(wb, eagle3, 5) / wb, 2) == 1.34


def test_a_run_cut_short_keeps_what_it_measured(monkeypatch):
    """Each group of measurements is checkpointed (the CLI writes the JSON each time): a failure after
    the rounds leaves the plain decoding and the rounds in the last checkpoint, without `complete`."""
    import copy

    def cut(*a, **k):
        raise KeyboardInterrupt  # what a timeout's signal looks like to the bench: not caught

    monkeypatch.setattr(gpu, "_batched", cut)
    saved: list[dict] = []
    cfg = gpu.GpuBenchConfig("tiny", "cpu", "fp32", prompt=16, tokens=4, batches=(1,), hf=False, legacy=False,
                             paged="off")
    with pytest.raises(KeyboardInterrupt):
        gpu.run_gpu_bench(cfg, log=lambda line: None, checkpoint=lambda res: saved.append(copy.deepcopy(res)))
    assert len(saved) == 2 and "complete" not in saved[-1]
    assert saved[0]["plain_ms"]["paged_eager"] > 0 and "rounds" not in saved[0]
    assert set(saved[-1]["rounds"]) == set(gpu.TREES)


def test_draft_parts_time_the_static_draft_and_restore_the_drafter(llama_pair):
    """On a drafter whose drafts run the static code (what the CUDA graphs replay; here eagerly), the
    parts are the draft graph and the host re-rank; afterwards nothing is left wrapped."""
    import torch

    import services.engine.drafter as drafter_module
    from services.spec.tree import TreeParams
    from tests.spec.test_tree_static import static_drafter

    head = llama_pair[2]
    d = static_drafter(head, TreeParams(4, 3, 16))
    d.start("s", 64, sampling=False)
    rerank, graphs_draft = drafter_module.rerank, type(d.graphs).draft
    with gpu.draft_parts(d, "cpu") as times:
        for n in (3, 1, 2):
            d.draft("s", torch.arange(n) + 5, torch.randn(n, head.config.feature_size))
    assert {p: len(ts) for p, ts in times.items()} == {gpu.DRAFT_CALL: 3, "draft graph: extension + expansion": 3,
                                                       "re-rank and tree (host)": 3}
    assert drafter_module.rerank is rerank and "draft" not in vars(d.graphs) and type(d.graphs).draft is graphs_draft
    assert "draft_many" not in vars(d)


def test_rounds_measure_each_on_device_step_turned_off(llama_pair, monkeypatch):
    """Where the engine keeps the round on the device (a static drafter and a paged verifier: the GPU's
    case, here eagerly on the CPU), each fixed tree's round is also measured with the queued draft
    re-ranked by the host after the verdict (the adaptive budget's rounds), without verdict drafts and
    without device trees, in the same run, and shown in the table beside it."""
    import services.engine.drafter as drafter_module
    from services.model.paged_kv import PagedKVPool
    from services.model.runner import ModelRunner
    from tests.spec.test_tree_static import static_drafter

    _, target, head = llama_pair
    monkeypatch.setattr(drafter_module, "Drafter", lambda h, tree: static_drafter(h, tree))
    monkeypatch.setattr(gpu, "device_split", lambda *a, **k: None)
    runner = ModelRunner(target, PagedKVPool.for_model(target, 2048), graphs=False)
    cfg = gpu.GpuBenchConfig("tiny", "cpu", "fp32", prompt=16, tokens=16, batches=(1,), hf=False, legacy=False)
    rounds = gpu._rounds(runner, head, tuple(range(1, 17)), cfg, 1.0, log=lambda line: None, trees=("16/3/4",))
    r = rounds["16/3/4"]
    assert r["device_trees"] is True and r["verdict_drafts"] is True and set(r["without"]) == set(gpu.WITHOUT)
    assert all(w["round_ms"] > 0 and w["plain_tokens"] > 0 for w in r["without"].values())
    assert r["verdict_counts"]["kept"] > 0 and not r["verdict_counts"].get("reranked")  # the fixed tree's way
    late = r["without"]["the re-rank in the hook (the adaptive budget's rounds)"]["verdict_counts"]
    assert late["reranked"] > 0 and not late.get("kept")
    res = {"rounds": rounds, "plain_ms": {}, "batched": {}, "device": "cpu", "shape": "tiny", "dtype": "fp32",
           "prompt": 16, "weight_gb": 0.0, "copy_tb_s": 0.0, "floor_ms": 0.0, "forward_ms": 0.0, "kernels_forward": 0}
    assert "without verdict drafts: ms (draft + verify)" in gpu.table(res)
    assert "without device trees: ms (draft + verify)" in gpu.table(res)


def test_batched_drafts_time_the_batch_together_alone_and_eagerly(llama_pair, monkeypatch):
    """Where the drafter drafts statically (the GPU's case, here eagerly on the CPU's paged arenas),
    `batched_drafts` times one draft call of N sequences drafted together (the batched static draft),
    one after another, and in the eager batch, and the table shows them."""
    import services.engine.drafter as drafter_module
    from tests.spec.test_tree_static import static_drafter

    _, _, head = llama_pair
    made = []

    def drafter(h, tree, max_sequences=64):
        made.append(static_drafter(h, tree))
        return made[-1]

    monkeypatch.setattr(drafter_module, "Drafter", drafter)
    cfg = gpu.GpuBenchConfig("tiny", "cpu", "fp32", prompt=16, tokens=16, batches=(1,), hf=False, legacy=False,
                             repeats=4)
    out = gpu._batched_drafts(head, cfg, log=lambda line: None)
    assert set(out) == {str(n) for n in gpu.DRAFT_BATCHES}
    assert all(v > 0 for times in out.values() for v in times.values())
    # per N: together (the batched draft), alone, eager (the batched path turned off)
    assert [d.graphs.batched > 0 for d in made] == [True, False, False] * len(gpu.DRAFT_BATCHES)
    res = {"rounds": {}, "plain_ms": {}, "batched": {}, "batched_drafts": out, "device": "cpu", "shape": "tiny",
           "dtype": "fp32", "prompt": 16, "weight_gb": 0.0, "copy_tb_s": 0.0, "floor_ms": 0.0, "forward_ms": 0.0,
           "kernels_forward": 0}
    assert "drafts of N=8 sequences: ms together, one after another, eager batch" in gpu.table(res)
