"""The distributed pipeline (verifier + drafter + coordinator over real gRPC, real Redis) streams
exactly what the in-process engine produces: greedy, seeded sampling, concurrent sequences with
different parameters, plain decoding; Redis holds exactly the streamed tokens."""

import json
import threading

import pytest
from prometheus_client import REGISTRY

from aerie_cli.main import main
from services.engine.engine import GenerationRequest
from services.rpc.coordinator_client import RemoteSession
from services.spec.sampling import SamplingParams
from tests.pipeline import TREE, local_engine, local_run, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)


@pytest.fixture(scope="module")
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference(model_dirs):
    return local_engine(model_dirs)


@pytest.fixture(scope="module")
def session(pipeline):
    s = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=120)
    yield s
    s.close()


def remote_run(session, req):
    steps = list(session.engine.generate(req))
    tokens = [t for s in steps for t in s.tokens]
    return tokens, steps[-1].finish_reason, [s.stats.accept_length for s in steps[1:]], steps


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.8, 0.95, 0, 11), SamplingParams(1.0, 1.0, 8, 5)],
                         ids=["greedy", "top_p", "top_k"])
def test_stream_equals_in_process_engine(session, pipeline, reference, sampling):
    req = GenerationRequest(PROMPT, 40, sampling)
    tokens, reason, accepts, steps = remote_run(session, req)
    assert (tokens, reason, accepts) == local_run(reference, req)
    assert [s.stats.round_index for s in steps] == list(range(len(steps)))
    assert session.tree == TREE and session.placement == (pipeline.addresses["drafter"], pipeline.addresses["verifier"])
    if sampling.greedy:
        assert max(accepts) > 1  # speculation really happens
    state = pipeline.coordinator.store.get(session.sequence_id)
    assert state.tokens == tokens and state.status == "finished" and state.round_index == len(steps) - 1
    assert state.prompt_ids == list(PROMPT) and state.params.temperature == sampling.temperature


def test_four_concurrent_sequences(session, pipeline, reference):
    reqs = [GenerationRequest((1, 2, 3), 30),
            GenerationRequest(PROMPT, 25, SamplingParams(0.9, 0.9, 0, 1)),
            GenerationRequest((7, 7, 7, 7, 9), 33, SamplingParams(0.6, 1.0, 20, 2)),
            GenerationRequest((100, 3), 40, stop_token_ids=(local_run(reference, GenerationRequest((100, 3), 40))[0][12],))]
    results: dict[int, tuple] = {}

    def worker(i):
        s = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=120)
        results[i] = remote_run(s, reqs[i])[:3] + (s.sequence_id,)
        s.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2, 3]
    for i, req in enumerate(reqs):
        tokens, reason, accepts, seq_id = results[i]
        assert (tokens, reason, accepts) == local_run(reference, req), f"request {i}"
        assert pipeline.coordinator.store.get(seq_id).tokens == tokens
    assert results[3][1] == "stop" and len(results[3][0]) == 13
    wait_until(lambda: pipeline.verifier.num_sequences == 0 and pipeline.drafter.drafter.num_sequences == 0)


def test_plain_decoding_and_any_coordinator_reads_any_sequence(session, pipeline, model_dirs, redis_url):
    _, address = pipeline.add_coordinator(redis_url, drafters=())
    plain = RemoteSession(address, None, "", timeout_s=60)
    req = GenerationRequest(PROMPT, 20, SamplingParams(0.7, 1.0, 0, 4))
    tokens, reason, accepts, _ = remote_run(plain, req)
    assert (tokens, reason, accepts) == local_run(local_engine(model_dirs, with_drafter=False), req)
    assert plain.tree is None and plain.placement[0] == ""
    # a sequence generated through the first coordinator, read through the second
    first = remote_run(session, GenerationRequest((9, 9), 12))[0]
    other = plain.get_sequence(session.sequence_id)
    assert list(other.tokens) == first and other.finish_reason == "length"
    plain.close()


def test_generate_cli_json_is_the_same_both_ways(pipeline, model_dirs, capsys):
    argv = ["generate", "--target", str(model_dirs.target), "--prompt-ids", "5,17,99,3",
            "--max-new-tokens", "24", "--temperature", "0.5", "--seed", "9", "--json"]
    model = ["--draft", str(model_dirs.head), "--dtype", "fp32", "--tree-top-k", "4", "--tree-depth", "3",
             "--tree-tokens", "16"]
    assert main([*argv, *model]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main([*argv, "--coordinator", pipeline.addresses["coordinator"]]) == 0
    remote = json.loads(capsys.readouterr().out)
    for key in ("tokens", "text", "accept_lengths", "tau", "rounds", "finish_reason", "prompt_tokens", "tree",
                "dtype"):
        assert remote[key] == local[key], key
    assert set(remote["timings"]) == set(local["timings"])
    assert main(["generate", "--coordinator", pipeline.addresses["coordinator"], "--target",
                 str(model_dirs.target), "--prompt-ids", "1,999"]) == 2
    assert capsys.readouterr().err.strip() == \
        "aerie: error: prompt token id 999 at position 1 is outside the vocabulary [0, 128)"


def test_metrics_are_recorded(session):
    """Measured as deltas: the registry is process-wide and earlier tests already filled it."""
    def value(name, service):
        return REGISTRY.get_sample_value(name, {"service": service}) or 0

    names = [("aerie_round_seconds_count", "coordinator"), ("aerie_accept_length_sum", "coordinator"),
             ("aerie_accept_length_count", "coordinator"), ("aerie_tokens_generated_total", "coordinator"),
             ("aerie_draft_seconds_count", "drafter"), ("aerie_verify_seconds_count", "verifier")]
    before = {n: value(*n) for n in names}
    tokens, _, accepts, steps = remote_run(session, GenerationRequest(PROMPT, 10))
    delta = {n[0]: value(*n) - before[n] for n in names}
    rounds = len(steps) - 1  # decode rounds (the prefill is round 0)
    assert delta["aerie_tokens_generated_total"] == len(tokens) == 10
    assert delta["aerie_accept_length_count"] == rounds and delta["aerie_accept_length_sum"] == sum(accepts)
    assert delta["aerie_round_seconds_count"] >= rounds
    assert delta["aerie_draft_seconds_count"] >= rounds and delta["aerie_verify_seconds_count"] >= rounds
    wait_until(lambda: value("aerie_sequences_in_flight", "coordinator") == 0)


def test_get_info_names_what_the_pipeline_serves(session, model_dirs):
    info = session.get_info()
    assert info.target == model_dirs.target.name and info.draft == model_dirs.head.name  # names, never paths
    assert (info.tree.top_k, info.tree.depth, info.tree.size) == (TREE.top_k, TREE.depth, TREE.size)
    assert info.dtype == "float32" and info.vocab_size == 128


@pytest.mark.parametrize("flag,value,where", [
    ("--tree-tokens", "60", "aerie drafter --tree-tokens / AERIE_TREE_TOKENS"),
    ("--tree-top-k", "4", "aerie drafter --tree-top-k / AERIE_TREE_TOP_K"),
    ("--tree-depth", "3", "aerie drafter --tree-depth / AERIE_TREE_DEPTH"),
    ("--draft", "none", "aerie drafter --draft / AERIE_DRAFT"),
    ("--dtype", "fp32", "AERIE_DTYPE"),
])
def test_generate_coordinator_refuses_flags_it_cannot_apply(pipeline, capsys, flag, value, where):
    code = main(["generate", "--coordinator", pipeline.addresses["coordinator"], "--prompt-ids", "1,2",
                 flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"aerie: error: {flag} does not apply with --coordinator: ") and where in err


def test_generate_coordinator_refuses_another_target(pipeline, model_dirs, capsys, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    code = main(["generate", "--coordinator", pipeline.addresses["coordinator"], "--target", str(other),
                 "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"--target {other} is not the target the pipeline at" in err
    assert f"({model_dirs.target.name}, from its GetInfo)" in err  # the served model's name, never its path
