"""`aerie bench`: table, JSON fields, chart, and exact match of aerie's methods with transformers in fp32."""

import json

import pytest

from aerie_cli.main import main
from tests.helpers import save_bench_dirs
from tests.pipeline import redis_url  # noqa: F401  (a real Redis for the pipeline method)


@pytest.fixture(scope="module")
def setup(llama_pair, tmp_path_factory):
    return save_bench_dirs(llama_pair, tmp_path_factory.mktemp("bench"))


def test_bench_fp32_exact_and_reports(setup, capsys):
    out_json, out_png = setup / "bench.json", setup / "bench.png"
    code = main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"),
                 "--dtype", "fp32", "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "24",
                 "--tree-tokens", "16", "--tree-depth", "3", "--tree-top-k", "4",
                 "--json-out", str(out_json), "--chart", str(out_png)])
    assert code == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "eagle" in table and "writing" in table
    res = json.loads(out_json.read_text())
    assert set(res["methods"]) == {"hf", "native", "eagle", "sam", "eagle+sam"}
    for m in ("native", "eagle", "sam", "eagle+sam"):
        row = res["methods"][m]
        assert row["exact_match"] == 1.0, m  # fp32: token for token equal to transformers
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    assert res["methods"]["eagle"]["tau"] > 1.0
    assert res["methods"]["native"]["tau"] == pytest.approx(1.0)
    # what does not apply is None in JSON and "-" in the table, never 0.0
    hf, native, eagle = (res["methods"][m] for m in ("hf", "native", "eagle"))
    assert [hf[k] for k in ("round_ms", "draft_ms", "verify_ms", "other_ms")] == [None] * 4
    assert native["draft_ms"] is None and native["verify_ms"] > 0 and eagle["draft_ms"] > 0
    cells = {line.split()[1]: line.split()[2:] for line in table.splitlines() if line.startswith("ALL")}
    assert cells["hf"][3:7] == ["-"] * 4 and cells["native"][4] == "-" and cells["eagle"][4] != "-"
    assert set(res["categories"]) == {"writing", "math"}
    assert res["categories"]["math"]["eagle"]["prompts"] == 2
    # end to end vs plain next to decode only (prefill excluded); hf exposes no prefill time
    assert native["vs_plain"] == 1.0 and native["decode_vs_plain"] == 1.0
    assert hf["decode_tokens_per_s"] is None and hf["prefill_share"] is None
    for m in ("native", "eagle", "sam", "eagle+sam"):
        row = res["methods"][m]
        assert 0 < row["prefill_share"] < 1 and row["decode_tokens_per_s"] > 0, m
        # decode-only rate: tokens after the first over the wall time after the prefill
        decode_s = row["seconds"] * (1 - row["prefill_share"])
        assert row["decode_tokens_per_s"] == pytest.approx((row["tokens"] - row["prompts"]) / decode_s, rel=0.01)
    assert native["chain_per_round"] == 0 and native["plain_round_share"] == 1.0
    assert res["methods"]["eagle"]["eagle_round_share"] == 1.0  # a fixed tree: every round drafts
    sam = res["methods"]["sam"]
    assert sam["chain_accepted_per_round"] <= sam["chain_per_round"]
    assert sam["plain_round_share"] == pytest.approx(1 - sam["chain_round_share"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sweep_reports_best_tree(setup, capsys):
    out_json = setup / "sweep.json"
    assert main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"), "--dtype", "fp32",
                 "--prompts", str(setup / "prompts.jsonl"), "--per-category", "1", "--max-new-tokens", "12",
                 "--methods", "hf", "--sweep", "--json-out", str(out_json)]) == 0
    res = json.loads(out_json.read_text())
    eagles = [m for m in res["methods"] if m.startswith("eagle")]
    assert len(eagles) >= 5 and res["best_tree"] in eagles and "eagle-auto" in eagles
    for m in eagles:  # the cost model's prediction next to the measurement, per shape
        assert res["methods"][m]["predicted_tokens_per_s"] > 0, m
        assert res["methods"][m]["measured_round_tokens_per_s"] > 0, m
    assert res["config"]["cost_model"]["verify"]["rows"][0] == 1
    assert set(res["categories"]) == {"writing", "math"} and res["methods"]["hf"]["prompts"] == 2
    assert all(res["methods"][m]["exact_match"] == 1.0 for m in eagles)


def test_bench_pipeline_method_matches(setup, redis_url, capsys):
    """Method (d): the same prompts through real gRPC services give the same tokens as transformers."""
    from tests.pipeline import ModelDirs, start_pipeline

    pipe = start_pipeline(ModelDirs(setup / "target", setup / "head"), redis_url)
    try:
        out_json = setup / "pipeline.json"
        assert main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"),
                     "--dtype", "fp32", "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "16",
                     "--tree-tokens", "16", "--tree-depth", "3", "--tree-top-k", "4",
                     "--methods", "hf,eagle,pipeline", "--coordinator", pipe.addresses["coordinator"],
                     "--json-out", str(out_json)]) == 0
    finally:
        pipe.close()
    res = json.loads(out_json.read_text())
    assert res["methods"]["pipeline"]["exact_match"] == 1.0
    assert res["methods"]["pipeline"]["tau"] == pytest.approx(res["methods"]["eagle"]["tau"])


def test_bench_reports_verify_latency_at_tp1_and_tp2(setup, capsys):
    """--tp-verify 2: the same verify measurement through a local TP=1 runner and a real TP=2 group
    (no timing assertion: only that both are measured and reported)."""
    out_json = setup / "tp.json"
    code = main(["bench", "--target", str(setup / "target"), "--draft", "none", "--dtype", "fp32",
                 "--prompts", str(setup / "prompts.jsonl"), "--limit", "1", "--max-new-tokens", "4",
                 "--methods", "hf,native", "--tp-verify", "2", "--json-out", str(out_json)])
    assert code == 0
    assert "verify latency, TP=1 vs TP=2" in capsys.readouterr().out
    tp = json.loads(out_json.read_text())["tp_verify"]
    assert tp["world"] == 2 and tp["rows"] == [1, 4, 16, 32]
    assert len(tp["tp1_ms"]) == len(tp["tp2_ms"]) == 4 and min(tp["tp1_ms"] + tp["tp2_ms"]) > 0
def test_bench_concurrency_through_the_services(setup, capsys):
    """`--concurrency`: in-process services (real gRPC, real Redis), plain / tree / adaptive at each
    level; the JSON's `concurrency` list has exactly the issue's fields; a PNG chart."""
    out_json, out_png = setup / "conc.json", setup / "conc.png"
    assert main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"), "--dtype", "fp32",
                 "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "8", "--concurrency", "1,3",
                 "--verifier-threads", "1", "--json-out", str(out_json), "--chart", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "ITL p50 ms" in out and "crossover" in out
    res = json.loads(out_json.read_text())
    rows = res["concurrency"]
    assert {(r["method"], r["concurrency"]) for r in rows} == {(m, n) for m in ("plain", "tree", "adaptive")
                                                               for n in (1, 3)}
    for r in rows:
        assert set(r) == {"method", "concurrency", "tokens_per_s", "itl_p50_ms", "itl_p99_ms"}
        assert r["tokens_per_s"] > 0 and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
    detail = {(d["method"], d["concurrency"]): d for d in res["concurrency_detail"]}
    assert all(not d["errors"] and d["tokens"] == 8 * d["concurrency"] for d in detail.values())
    assert detail[("plain", 3)]["mean_nodes"] == 1.0 and detail[("tree", 3)]["mean_nodes"] > 1
    assert all(d["steady_tokens_per_s"] >= 0 for d in detail.values())
    assert {(d["method"], d["concurrency"]) for d in res["concurrency_decode"]} == set(detail)
    # where the time goes: every service's CPU per token, and the verifier's forwards (its /metrics)
    for (m, n), d in detail.items():
        cpu = d["cpu_ms_per_token"]
        assert {"verifier", f"coordinator-{m}", "client"} <= set(cpu) and cpu["verifier"] > 0
        f = d["verifier_forwards"]
        # a prefill and at least one round per sequence, at most n calls per forward
        assert 2 <= f["forwards"] <= 8 * n and 1 <= f["calls_per_forward"] <= n
        # the coordinator's per-round latencies: at most 7 decode rounds per sequence (7 when plain)
        r = d["round_ms"]
        assert n <= r["verify_rounds"] == r["round_rounds"] <= 7 * n and 0 < r["verify"] <= r["round"]
        if m == "plain":  # n prefills + 7 decode steps each: 8n calls
            assert round(f["forwards"] * f["calls_per_forward"]) == 8 * n
            assert r["verify_rounds"] == 7 * n and "draft" not in r
            assert d["drafter_forwards"] == {} and d["detached_rounds"] == 0
        elif m == "tree":  # a fixed shape drafts every round: never detached
            assert d["drafter_forwards"]["forwards"] >= 1 and d["detached_rounds"] == 0
            assert r["draft_rounds"] == r["verify_rounds"] and r["draft"] > 0
        else:
            assert 0 <= d["detached_rounds"] <= 7 * n
    assert "decode tok/s" in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bench", "--target", str(setup / "target"), "--prompts", str(setup / "prompts.jsonl"),
                 "--concurrency", "0,2"]) == 2
    assert "--concurrency levels must be >= 1; got '0,2'" in capsys.readouterr().err
    assert res["concurrency_config"]["verifier_threads"] == 1
    assert main(["bench", "--target", str(setup / "target"), "--prompts", str(setup / "prompts.jsonl"),
                 "--concurrency", "1,2", "--verifier-threads", "0"]) == 2
    assert "--verifier-threads must be >= 1; got 0" in capsys.readouterr().err



def test_bench_concurrency_with_drafting_ahead(setup, capsys):
    """`--concurrency-methods adaptive,overlap`: the overlap method starts its own drafter (ahead rows)
    and a coordinator with `--overlap on`; every sequence completes, and the detail counts the
    rounds that drafted ahead and their hits from the coordinator's metrics (whether the learning
    policy drafts ahead depends on measured seconds: only the bounds are checked)."""
    out_json = setup / "conc-overlap.json"
    assert main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"), "--dtype", "fp32",
                 "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "8", "--concurrency", "1,2",
                 "--concurrency-methods", "adaptive,overlap", "--json-out", str(out_json)]) == 0
    assert "ahead rounds" in capsys.readouterr().out
    res = json.loads(out_json.read_text())
    assert {(r["method"], r["concurrency"]) for r in res["concurrency"]} == {
        (m, n) for m in ("adaptive", "overlap") for n in (1, 2)}
    for d in res["concurrency_detail"]:
        assert not d["errors"] and d["tokens"] == 8 * d["concurrency"]
        assert 0 <= d["ahead_hits"] <= d["ahead_rounds"] <= 7 * d["concurrency"]
        if d["method"] == "adaptive":
            assert d["ahead_rounds"] == 0

def test_bench_concurrency_with_direct_drafts(setup, capsys):
    """`--concurrency-methods tree,direct,direct-ahead`: the direct methods' coordinators (`--direct-drafts
    1`; direct-ahead also `--overlap on`, on a fixed-shape drafter with `--ahead-branches 2`); every
    sequence completes, and the detail counts the rounds whose tree the verifier had drafted at the
    drafter (none for `tree`) and the rounds drafted ahead (at most one a round)."""
    out_json = setup / "conc-direct.json"
    assert main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"), "--dtype", "fp32",
                 "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "12", "--concurrency", "1,2",
                 "--concurrency-methods", "tree,direct,direct-ahead", "--json-out", str(out_json)]) == 0
    assert "drafts in verify" in capsys.readouterr().out
    res = json.loads(out_json.read_text())
    assert {(r["method"], r["concurrency"]) for r in res["concurrency"]} == {
        (m, n) for m in ("tree", "direct", "direct-ahead") for n in (1, 2)}
    for d in res["concurrency_detail"]:
        assert not d["errors"] and d["tokens"] == 12 * d["concurrency"]
        assert (d["drafts_in_verify"] > 0) == d["method"].startswith("direct"), d
        assert 0 <= d["ahead_hits"] <= d["ahead_rounds"] <= 11 * d["concurrency"]
        if d["method"] != "direct-ahead":
            assert d["ahead_rounds"] == 0


def test_round_ms_from_two_coordinator_scrapes():
    from services.bench.concurrency import round_ms, round_totals

    svc = '{service="coordinator"}'
    before = round_totals(f"aerie_verify_seconds_sum{svc} 1.0\naerie_verify_seconds_count{svc} 10.0\n"
                          f"aerie_draft_seconds_sum{svc} 0.5\naerie_draft_seconds_count{svc} 5.0\n"
                          'aerie_verify_seconds_sum{service="verifier"} 99.0')
    assert before == {"verify_sum": 1.0, "verify_count": 10.0, "draft_sum": 0.5, "draft_count": 5.0}
    after = {"verify_sum": 2.5, "verify_count": 40.0, "draft_sum": 0.5, "draft_count": 5.0}
    assert round_ms(before, after) == {"verify": 50.0, "verify_rounds": 30}  # no new draft: absent


def test_forward_shape_from_two_metric_scrapes():
    from services.bench.concurrency import batch_totals, forward_shape

    text = "\n".join(['aerie_batch_size_count{service="verifier"} 10.0', 'aerie_batch_size_sum{service="verifier"} 40.0',
                      'aerie_batch_rows_sum{service="verifier"} 400.0', 'aerie_batch_size_count{service="drafter"} 99.0',
                      '# HELP aerie_batch_size Calls gathered'])
    before = batch_totals(text, "verifier")
    assert before == {"forwards": 10.0, "calls": 40.0, "rows": 400.0}
    after = {"forwards": 14.0, "calls": 72.0, "rows": 432.0}
    assert forward_shape(before, after) == {"forwards": 4, "calls_per_forward": 8.0, "rows_per_forward": 8.0}
    assert forward_shape({}, after) == {} and forward_shape(after, after) == {"forwards": 0}


def test_metric_delta_reads_one_sample_of_two_scrapes():
    from services.bench.concurrency import metric_delta

    sample = 'aerie_detached_rounds_total{service="coordinator"}'
    assert metric_delta("", f"{sample} 7.0\n", sample) == 7.0  # absent before: never incremented
    assert metric_delta(f"{sample} 3.0", f"# HELP x\n{sample} 10.0", sample) == 7.0


def test_bench_categories_picks_those_and_names_one_the_file_lacks(setup, capsys):
    from services.bench.bench import load_prompts
    from services.errors import InvalidRequest
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup / "target"))
    got = load_prompts(setup / "prompts.jsonl", tok, categories=("math",))
    assert [p.category for p in got] == ["math", "math"] and [p.question_id for p in got] == ["1", "3"]
    assert len(load_prompts(setup / "prompts.jsonl", tok, per_category=1, categories=("math", "writing"))) == 2
    with pytest.raises(InvalidRequest, match=r"has no category 'rag'; it has math, writing"):
        load_prompts(setup / "prompts.jsonl", tok, categories=("math", "rag"))
    code = main(["bench", "--target", str(setup / "target"), "--prompts", str(setup / "prompts.jsonl"),
                 "--categories", "writing", "--methods", "hf,native", "--max-new-tokens", "4",
                 "--json-out", str(setup / "cat.json")])
    assert code == 0
    res = json.loads((setup / "cat.json").read_text())
    assert set(res["categories"]) == {"writing"} and res["config"]["categories"] == ["writing"]


def test_bench_reports_drafting_ahead(setup, capsys):
    """Method eagle+ahead: the EAGLE engine drafting the next tree ahead is exact, and the table shows
    the share of rounds that drafted ahead and the guess hit-rate (the values are timing-free counts)."""
    out_json = setup / "ahead.json"
    code = main(["bench", "--target", str(setup / "target"), "--draft", str(setup / "head"),
                 "--dtype", "fp32", "--prompts", str(setup / "prompts.jsonl"), "--max-new-tokens", "24",
                 "--tree-tokens", "16", "--tree-depth", "3", "--tree-top-k", "4", "--limit", "2",
                 "--methods", "hf,eagle,eagle+ahead", "--json-out", str(out_json)])
    assert code == 0
    table = capsys.readouterr().out
    assert "ahead rds" in table and "guess hit" in table
    res = json.loads(out_json.read_text())
    ahead, eagle = res["methods"]["eagle+ahead"], res["methods"]["eagle"]
    assert ahead["exact_match"] == 1.0 and eagle["exact_match"] == 1.0
    assert eagle["ahead_share"] is None and eagle["guess_hit_rate"] is None
    assert ahead["ahead_share"] is not None and 0 <= ahead["guess_hit_rate"] <= 1
