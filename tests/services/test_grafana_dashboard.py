"""docs/grafana/aerie-serving.json: valid, laid out without overlaps, and every series it queries is
one services/metrics.py exports (a renamed metric breaks this test, not a dashboard in production)."""

import json
import re
from pathlib import Path

from services import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "aerie-serving.json"


def panels():
    return json.loads(DASHBOARD.read_text())["panels"]


def test_every_queried_series_is_exported():
    exported = set(metrics.REGISTRY._names_to_collectors)  # every sample name: _total, _bucket, _sum, _count
    queried = {name for p in panels() for t in p.get("targets", [])
               for name in re.findall(r"\baerie[:_][A-Za-z0-9_:]*", t["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)
    for name in ("aerie:kv_cache_usage_perc", "aerie:request_queue_time_seconds_bucket",
                 "aerie:request_prefill_time_seconds_bucket", "aerie:request_decode_time_seconds_bucket",
                 "aerie:request_prompt_tokens_bucket", "aerie:request_generation_tokens_bucket",
                 "aerie:num_requests_running", "aerie:num_requests_waiting",
                 "aerie:spec_decode_num_accepted_tokens_total"):
        assert name in queried, name


def test_layout_and_ids():
    ps = panels()
    assert len({p["id"] for p in ps}) == len(ps)
    boxes = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in ps]
    for i, (x, y, w, h) in enumerate(boxes):
        assert x + w <= 24
        for x2, y2, w2, h2 in boxes[i + 1:]:
            assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, (x, y, w, h, x2, y2, w2, h2)


def test_model_series_follow_the_model_variable():
    for p in panels():
        for t in p.get("targets", []):
            if "aerie:" in t["expr"]:
                assert 'model_name=~"$model_name"' in t["expr"], (p["title"], t["expr"])
