"""The verifier's vLLM limits: --max-model-len lowers (never raises) the context it reports and serves,
and --gpu-memory-utilization sets the KV budget on CUDA (F x total - in use, from a synthetic memory
reading: no GPU needed) and has no effect on the CPU."""

import asyncio
import logging

import pytest

from services.rpc.config import ConfigError, ServiceConfig
from services.rpc.stubs import common as pb
from tests.pipeline import HOST
from verifier_svc.config import VerifierConfig
from verifier_svc.server import load_servicer
from verifier_svc.servicer import context_limit, kv_budget_rows

GIB = 2 ** 30


def config(**kw) -> VerifierConfig:
    return VerifierConfig(ServiceConfig(host=HOST), **kw)


def test_context_limit():
    assert context_limit(512, None) == 512 and context_limit(512, 100) == 100 and context_limit(512, 512) == 512
    with pytest.raises(ConfigError, match="--max-model-len 600 is larger than the model's context of 512 tokens"):
        context_limit(512, 600)


def test_the_verifier_reports_and_sizes_by_max_model_len(model_dirs):
    servicer = load_servicer(config(target=str(model_dirs.target), dtype="fp32", max_model_len=100,
                                    max_tree_nodes=16))
    try:
        info = asyncio.run(servicer.GetInfo(pb.InfoRequest(), None))
        assert info.max_context == 100 and servicer.max_capacity == 100 + 16
    finally:
        servicer.close()
    with pytest.raises(ConfigError, match="larger than the model's context"):
        load_servicer(config(target=str(model_dirs.target), dtype="fp32", max_model_len=10 ** 6))


def test_gpu_memory_utilization_on_cuda():
    """80 GiB GPU with 20 GiB in use after loading: 0.9 leaves 0.9 x 80 - 20 = 52 GiB of KV."""
    memory = lambda device: (60 * GIB, 80 * GIB)  # noqa: E731  (free, total)
    rows = kv_budget_rows(config(gpu_memory_utilization=0.9), 4096, "cuda:0", memory)
    assert rows == int(0.9 * 80 * GIB - 20 * GIB) // 4096
    with pytest.raises(ConfigError, match="--gpu-memory-utilization 0.2 leaves no KV memory: 20.0 GiB of the "
                                          "GPU's 80.0 GiB are in use"):
        kv_budget_rows(config(gpu_memory_utilization=0.2), 4096, "cuda:0", memory)


def test_gpu_memory_utilization_has_no_effect_on_the_cpu(caplog):
    never = lambda device: pytest.fail("a CPU budget never reads GPU memory")  # noqa: E731
    with caplog.at_level(logging.WARNING):
        same = kv_budget_rows(config(gpu_memory_utilization=0.9, kv_budget_share=0), 4096, "cpu", never)
    assert same is None  # as --kv-budget-share 0 alone: unbounded
    assert "--gpu-memory-utilization 0.9 has no effect on the CPU" in caplog.text


@pytest.mark.parametrize("kw,message", [
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
    ({"gpu_memory_utilization": 0.5, "kv_budget_mb": 100.0}, "not both"),
    ({"max_model_len": 1}, "max_model_len must be >= 2"),
])
def test_invalid_values(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(**kw)
