"""coordinator/request_metrics.py: a round counts as a draft only when it verified a draft token (a
plain step's root-only tree does not), and the per-request series observe once per request."""

from coordinator.request_metrics import RequestMetrics
from services import metrics
from services.engine.engine import RoundStats

MODEL = "request-metrics-test"


def value(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0


def stats(index, accept, size, depth):
    return RoundStats(round_index=index, accept_length=accept, tree_size=size, tree_max_depth=depth, draft_s=0.0, verify_s=0.0)


def test_a_plain_step_is_not_a_draft():
    m = RequestMetrics(MODEL)
    m.admitted(5)
    m.round(stats(0, 1, 0, 0), 1)  # prefill
    m.round(stats(1, 1, 1, 0), 1)  # a plain step: the root alone
    m.round(stats(2, 3, 8, 3), 3)  # a tree of depth 3: 2 drafts accepted + the bonus
    m.finished("length")
    m.close()
    assert value("aerie:spec_decode_num_drafts_total") == 1
    assert value("aerie:spec_decode_num_draft_tokens_total") == 3
    assert value("aerie:spec_decode_num_accepted_tokens_total") == 2
    for name in ("aerie:request_queue_time_seconds", "aerie:request_prefill_time_seconds",
                 "aerie:request_decode_time_seconds"):
        assert value(f"{name}_count") == 1
    assert value("aerie:request_prompt_tokens_sum") == 5 and value("aerie:request_generation_tokens_sum") == 5
    assert value("aerie:num_requests_running") == 0 and value("aerie:num_requests_waiting") == 0
