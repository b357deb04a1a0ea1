"""`aerie bench serve` against a real aerie HTTP gateway on loopback (verifier, drafter, coordinator,
Redis, the tiny target with its word-level tokenizer: one word per token). The numbers are checked
against each other and against what was streamed, never against a speed."""

import json
import math
import socket

import pytest

from aerie_cli.main import main as aerie_main
from gateway.server import start_http
from services.bench.serve import arrival_gaps, parse_spec_counters, percentiles
from services.bench.serve_report import chart
from tests.pipeline import HOST, start_pipeline

PROMPTS = ["t5 t17 t9", "t1 t2 t3 t4", "t8 t8 t8", "t40 t41 t42 t43 t44"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base_url(text_model_dirs, redis_url):
    p = start_pipeline(text_model_dirs, redis_url)
    http = p.loop.run(start_http(p.addresses["coordinator"], HOST, 0))
    yield f"http://{HOST}:{http.port}"
    p.loop.run(http.stop())
    p.close()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def bench(base_url, prompt_file, tmp_path, *extra) -> dict:
    out = tmp_path / "result.json"
    code = aerie_main(["bench", "serve", "--base-url", base_url + "/v1", "--prompts", str(prompt_file),
                       "--endpoint", "/v1/completions", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                       "--extra-body", '{"skip_special_tokens": false}', "--label", "aerie",
                       "--json-out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_metrics_come_from_the_streamed_timestamps(base_url, prompt_file, tmp_path, capsys):
    r = bench(base_url, prompt_file, tmp_path, "--max-concurrency", "2", "--num-prompts", "6",
              "--chart", str(tmp_path / "serve.png"))
    assert (r["completed"], r["failed"], r["model"]) == (6, 0, "target")  # the model from GET /v1/models
    assert r["output_tokens_from"] == "usage"
    for q in r["requests"]:
        assert 0 < q["ttft_s"] <= q["e2e_s"]
        assert q["output_tokens"] == MAX_TOKENS == len(q["text"].split())  # usage = the words streamed
        assert len(q["itl_s"]) == q["chunks"] - 1 and sum(q["itl_s"]) <= q["e2e_s"] - q["ttft_s"]
        assert q["text"].split()[0].startswith("t")
    e2e = [q["e2e_s"] for q in r["requests"]]
    assert r["duration_s"] >= max(e2e)
    assert r["request_throughput"] == 6 / r["duration_s"]
    assert r["output_throughput"] == 6 * MAX_TOKENS / r["duration_s"] and r["total_output_tokens"] == 48
    assert r["total_input_tokens"] == sum(len(PROMPTS[q["prompt_index"]].split()) for q in r["requests"])
    assert r["ttft_ms"]["mean"] == pytest.approx(1000 * sum(q["ttft_s"] for q in r["requests"]) / 6)
    assert r["e2e_ms"]["median"] <= r["e2e_ms"]["p99"] <= 1000 * max(e2e) + 1e-9
    tpot = [(q["e2e_s"] - q["ttft_s"]) / (MAX_TOKENS - 1) for q in r["requests"]]
    assert r["tpot_ms"]["mean"] == pytest.approx(1000 * sum(tpot) / 6)
    # the pipeline drafts with the head: acceptance read from the gateway's /metrics before and after
    acc = r["acceptance"]
    assert acc["drafts"] > 0 and 0 <= acc["accepted_tokens"] <= acc["draft_tokens"]
    assert acc["acceptance_rate"] == acc["accepted_tokens"] / acc["draft_tokens"]
    assert acc["mean_accept_length"] == 1 + acc["accepted_tokens"] / acc["drafts"]
    assert r["config"]["max_concurrency"] == 2 and r["threads"] and r["machine"]
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["server", "ok/fail", "req/s"] and "aerie" in out
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_greedy_outputs_repeat_across_runs_and_rates(base_url, prompt_file, tmp_path):
    a = bench(base_url, prompt_file, tmp_path, "--seed", "3")
    b = bench(base_url, prompt_file, tmp_path, "--seed", "3", "--request-rate", "50")
    assert a["config"]["request_rate"] == "inf" and b["config"]["request_rate"] == 50
    texts = lambda r: {q["prompt_index"]: q["text"] for q in r["requests"]}  # noqa: E731
    assert texts(a) == texts(b) and len(texts(a)) == len(PROMPTS)


def test_chart_legend_is_outside_the_bars(tmp_path):
    def fake(label, k):
        lat = {"mean": 10.0 * k, "median": 9.0 * k, "p99": 30.0 * k}
        return {"label": label, "machine": "cpu", "threads": "1", "completed": 1, "failed": 0,
                "request_throughput": 2.0 * k, "output_throughput": 200.0 * k, "acceptance": None,
                "ttft_ms": lat, "tpot_ms": lat, "itl_ms": lat, "e2e_ms": lat,
                "config": {"num_prompts": 4, "request_rate": "inf", "max_concurrency": 2, "max_tokens": 8}}

    legend, *axes = chart([fake("aerie", 1), fake("vllm", 2), fake("sglang", 3)], tmp_path / "c.png")
    for ax in axes:
        assert not legend.overlaps(ax)


def test_unreachable_server_exits_4(prompt_file, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert aerie_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--prompts", str(prompt_file)]) == 4
    assert "cannot reach http://127.0.0.1:" in capsys.readouterr().err


def test_helpers():
    assert arrival_gaps(3, math.inf, 0) == [0.0, 0.0, 0.0]
    gaps = arrival_gaps(50, 10.0, 7)
    assert gaps == arrival_gaps(50, 10.0, 7) and gaps[0] == 0 and all(g > 0 for g in gaps[1:])
    assert percentiles([1.0, 2.0, 3.0, 4.0], scale=1) == pytest.approx({"mean": 2.5, "median": 2.5, "p99": 3.97})
    vllm = ("vllm:spec_decode_num_drafts_total{model_name=\"m\"} 4.0\n"
            "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 12.0\n"
            "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 7.0\n")
    assert parse_spec_counters(vllm) == {"spec_decode_num_drafts": 4.0, "spec_decode_num_draft_tokens": 12.0,
                                         "spec_decode_num_accepted_tokens": 7.0}
    assert parse_spec_counters("# sglang exports other names\nsglang:num_running_reqs 1\n") == {}


def scrape(base_url) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the gateway's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples, name, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def test_dashboard_series_follow_the_requests(base_url, prompt_file, tmp_path):
    """Queue, prefill and decode time, prompt and output lengths: one observation per request, the
    lengths adding up to the streamed usage; KV usage a fraction of the verifier's budget."""
    names = ["aerie:request_queue_time_seconds", "aerie:request_prefill_time_seconds",
             "aerie:request_decode_time_seconds", "aerie:request_prompt_tokens", "aerie:request_generation_tokens"]
    before = scrape(base_url)
    r = bench(base_url, prompt_file, tmp_path, "--max-concurrency", "2")
    after = scrape(base_url)
    delta = {f"{n}_{part}": total(after, f"{n}_{part}", model_name="target") -
             total(before, f"{n}_{part}", model_name="target") for n in names for part in ("count", "sum")}
    n = len(PROMPTS)
    assert all(delta[f"{name}_count"] == n for name in names), delta
    assert delta["aerie:request_generation_tokens_sum"] == r["total_output_tokens"] == n * MAX_TOKENS
    assert delta["aerie:request_prompt_tokens_sum"] == r["total_input_tokens"]
    # per request, queue + prefill <= TTFT and queue + prefill + decode <= E2E as the client saw them
    server_side = (delta["aerie:request_queue_time_seconds_sum"] + delta["aerie:request_prefill_time_seconds_sum"]
                   + delta["aerie:request_decode_time_seconds_sum"])
    assert 0 < server_side <= sum(q["e2e_s"] for q in r["requests"])
    usage = [v for (name, _), v in after.items() if name == "aerie:kv_cache_usage_perc"]
    assert usage and all(0 <= u <= 1 for u in usage)
