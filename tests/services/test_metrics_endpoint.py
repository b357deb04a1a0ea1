"""The Prometheus endpoint answers /metrics only: any other path (a health probe, /) is a 404."""

import urllib.error
import urllib.request

import pytest

from services import metrics


@pytest.fixture(scope="module")
def base():
    port = metrics.serve_metrics(0, "127.0.0.1")
    return f"http://127.0.0.1:{port}"


def test_metrics_path_serves_the_registry(base):
    metrics.TOKENS_GENERATED.labels("coordinator").inc(0)
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        body = r.read().decode()
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert "aerie_tokens_generated_total" in body and "aerie_round_seconds" in body


@pytest.mark.parametrize("path", ["/health", "/", "/metricsx", "/healthz"])
def test_other_paths_are_404(base, path):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + path, timeout=10)
    assert e.value.code == 404 and b"aerie_" not in e.value.read()


def test_off_when_no_port():
    assert metrics.serve_metrics(None) is None
