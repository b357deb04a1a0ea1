"""The device-time split's arithmetic (services/bench/device_time.py); the profiling itself needs CUDA."""

from services.bench.device_time import busy_us, device_split, kind_of


def test_busy_is_the_union_of_the_intervals():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22), (12, 13)]) == 18  # 0-13 and 20-25
    assert busy_us([(30, 40), (0, 1)]) == 11  # any order


def test_kernels_are_sorted_into_kinds_by_name():
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "nvjet_tst_64x8_64x16_2x1_v_bz_TNN": "gemm",
             "_attend_kernel": "attention", "_merge_kernel": "attention", "triton_per_fused_add_mean_mul_pow_rsqrt_0": "fused",
             "Memcpy DtoD (Device -> Device)": "copy", "void at::native::index_elementwise_kernel": "copy",
             "void at::native::vectorized_elementwise_kernel": "other"}
    assert {n: kind_of(n) for n in names} == names


def test_no_split_off_cuda():
    assert device_split(None, (1, 2), 8, "cpu") is None


def test_the_split_runs_the_engine_s_rounds_under_the_profiler():
    """The profiled passes on the CPU (no kernels there): rounds counted, the host's busiest ops
    listed; a sequence cut short by the split is released (the generator is closed)."""
    import torch

    from services.bench.device_time import split
    from services.bench.gpu import _paged, random_target
    from services.engine.engine import Engine
    from services.engine.verifier import Verifier
    from services.model.runner import ModelRunner

    target = random_target("tiny", "cpu", torch.float32)
    verifier = Verifier(None, "hidden", runner=ModelRunner(target, _paged(target, 1024), graphs=False))
    engine = Engine(verifier, None, target.config.max_context, target.config.vocab_size, plain_run=4)
    out = split(engine, tuple(range(1, 33)), 3, "cpu")
    assert out["rounds"] == 3 and out["wall_ms"] > 0 and out["kernels"] == 0 and out["top_kernels"] == []
    host = out["host"]
    assert host["runtime_calls"] == {} and 0 < len(host["top_host_ops"]) <= 15
    assert all(op["calls"] > 0 and op["ms"] >= 0 for op in host["top_host_ops"])
    assert verifier.num_sequences == 0
