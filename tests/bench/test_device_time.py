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
