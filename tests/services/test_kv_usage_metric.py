"""aerie:kv_cache_usage_perc reads the verifier's KV pool: rows held over its KV budget, 0..1."""

from services import metrics
from services.rpc.config import ServiceConfig
from verifier_svc.config import VerifierConfig
from verifier_svc.server import load_servicer


def gauge(name: str) -> float:
    return metrics.REGISTRY.get_sample_value("aerie:kv_cache_usage_perc", {"model_name": name})


def test_kv_usage_is_rows_held_over_the_budget(model_dirs):
    config = VerifierConfig(ServiceConfig(host="127.0.0.1"), target=str(model_dirs.target), dtype="fp32",
                            kv_budget_mb=1.0)
    servicer = load_servicer(config)
    try:
        pool = servicer.runner.pool
        assert pool.max_rows == int(2 ** 20 // pool.bytes_per_row)  # 1 MiB of KV rows
        assert gauge("target") == 0.0
        slot = pool.allocate(pool.max_rows // 4)
        assert gauge("target") == (pool.max_rows // 4) / pool.max_rows
        pool.release(slot)
        assert gauge("target") == 0.0
    finally:
        servicer.close()
