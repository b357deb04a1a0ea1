"""Limits a caller cannot override (issue 15, item 1): documented bounds on what one request carries,
the verifier's and drafter's own caps on KV capacity and tree size, and the coordinator's per-client
concurrency limit. Real servers on loopback, real Redis, tiny real models."""

import grpc
import pytest
import redis
import torch

from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.spec.tree import DraftTree
from services.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.pipeline import start_pipeline, wait_until

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
ROWS = 100  # the verifier's AERIE_MAX_SEQUENCE_ROWS in these tests
TREE_NODES = 16  # its AERIE_MAX_TREE_NODES: the pipeline drafter's trees (16 nodes) fit


@pytest.fixture(scope="module")
def pipeline(text_model_dirs, redis_url):
    p = start_pipeline(text_model_dirs, redis_url, max_new_tokens=64, max_sequences_per_client=2,
                       verifier_overrides=dict(max_sequence_rows=ROWS, max_tree_nodes=TREE_NODES))
    yield p
    p.close()


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return e.value.code(), e.value.details()


def sequences_in_redis(url: str) -> int:
    client = redis.Redis.from_url(url)
    return sum(1 for k in client.scan_iter("aerie:seq:*") if not k.endswith(b":tokens"))


@pytest.mark.parametrize("request_kw, message", [
    (dict(stop_token_ids=list(range(codec.MAX_STOP_TOKEN_IDS + 1))),
     f"stop_token_ids may hold at most {codec.MAX_STOP_TOKEN_IDS} ids; got {codec.MAX_STOP_TOKEN_IDS + 1}"),
    (dict(stop=["t5"] * (MAX_STOP_STRINGS + 1)),
     f"stop may hold at most {MAX_STOP_STRINGS} strings; got {MAX_STOP_STRINGS + 1}"),
    (dict(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]),
     f"stop[1] has {MAX_STOP_STRING_CHARS + 1} characters; a stop string may have at most {MAX_STOP_STRING_CHARS}"),
    (dict(sampling=pb.SamplingParams(temperature=1.0, top_k=codec.MAX_TOP_K + 1)),
     f"top_k must be <= {codec.MAX_TOP_K} (0 = off); got {codec.MAX_TOP_K + 1}"),
    (dict(sampling=pb.SamplingParams(temperature=1.0, seed=2**63)),
     "seed must be in [0, 2**63); got 9223372036854775808"),
    (dict(max_new_tokens=65), "max_new_tokens must be <= 64 on this coordinator; got 65"),
    (dict(sampling=pb.SamplingParams(temperature=float("nan"))), "temperature must be >= 0; got nan"),
    (dict(sampling=pb.SamplingParams(temperature=1.0, top_p=float("inf"))), "top_p must be in (0, 1]; got inf"),
])
def test_request_over_a_documented_bound_is_refused_naming_it(pipeline, redis_url, request_kw, message):
    before = sequences_in_redis(redis_url)
    request = cpb.GenerateRequest(prompt_ids=[1, 2, 3], **request_kw)
    assert status_of(lambda: pipeline.coordinator_stub().Generate(request, timeout=30)) == (INVALID, message)
    assert sequences_in_redis(redis_url) == before  # refused before anything was stored
    assert pipeline.verifier.num_sequences == 0


def test_verifier_capacity_is_capped_by_its_own_config(pipeline):
    """Verifier.Prefill(capacity=12288) called directly pinned 540 MB on the default model: the cap is
    the server's AERIE_MAX_SEQUENCE_ROWS, whatever the caller asks."""
    stub = pipeline.verifier_stub()
    request = vpb.VerifierPrefillRequest(sequence_id="greedy-caller", prompt_ids=[1, 2, 3], capacity=12288,
                                         feature_kind=pb.FEATURE_KIND_HIDDEN)
    assert status_of(lambda: stub.Prefill(request, timeout=30)) == (
        INVALID, f"capacity must be in [4, {ROWS}] for a 3-token prompt (this verifier's limit, "
                 f"AERIE_MAX_SEQUENCE_ROWS); got 12288")
    assert pipeline.verifier.num_sequences == 0
    request.capacity = ROWS  # at the limit: accepted
    list(stub.Prefill(request, timeout=30))
    assert pipeline.verifier.num_sequences == 1
    # a tree over the server's AERIE_MAX_TREE_NODES is refused before any forward
    n = TREE_NODES + 1
    tree = DraftTree(tokens=torch.arange(n), parents=torch.tensor([-1] + list(range(n - 1))),
                     scores=torch.zeros(n), paths=torch.arange(n).unsqueeze(0), depths=torch.arange(n),
                     mask=torch.ones(n, n, dtype=torch.bool).tril())
    verify = vpb.VerifyRequest(sequence_id="greedy-caller", round_index=1, tree=codec.encode_tree(tree))
    assert status_of(lambda: stub.Verify(verify, timeout=30)) == (
        INVALID, f"tree must have 1 to {TREE_NODES} nodes (this server's limit, AERIE_MAX_TREE_NODES); got {n}")
    stub.Release(pb.ReleaseRequest(sequence_id="greedy-caller"), timeout=10)
    assert pipeline.verifier.num_sequences == 0


def test_drafter_rows_are_capped_by_its_own_config(pipeline):
    f = pipeline.drafter.drafter.head.config.feature_size
    cap = pipeline.drafter.max_rows
    first = dpb.DrafterPrefillRequest(sequence_id="rows", tokens=[1, 2], max_rows=cap + 1,
                                      features=codec.encode_tensor(torch.zeros(2, f)))
    assert status_of(lambda: pipeline.drafter_stub().Prefill(iter([first]), timeout=30)) == (
        INVALID, f"max_rows must be in [2, {cap}] (this drafter's limit: the target's context + "
                 f"AERIE_MAX_TREE_NODES); got {cap + 1}")
    assert cap == 512 + 512  # the tiny target's context + the default AERIE_MAX_TREE_NODES, not + 4096


def test_per_client_concurrency_limit(pipeline):
    """Two streams open from this peer (the limit): a third is RESOURCE_EXHAUSTED naming the limit
    and costs nothing; when one ends, the next is admitted. The verifier's worker is held busy so the
    two streams stay open for as long as the test needs."""
    import threading

    servicer = pipeline.coordinator.servicer
    key = "peer ipv4:127.0.0.1"
    stub = pipeline.coordinator_stub()
    request = cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True)
    gate = threading.Event()
    held = pipeline.verifier.batcher.exclusive(gate.wait)  # the model thread waits
    try:
        open_streams = [stub.Generate(request, timeout=60) for _ in range(2)]
        wait_until(lambda: servicer._per_client.get(key) == 2)
        code, details = status_of(lambda: stub.Generate(request, timeout=30))
        assert code == EXHAUSTED
        assert details == (f"{key} already has 2 sequences open on this coordinator, its limit "
                           "(AERIE_MAX_SEQUENCES_PER_CLIENT=2)")
        open_streams[0].cancel()
        wait_until(lambda: servicer._per_client.get(key) == 1)
    finally:
        gate.set()
    assert held is not None
    assert list(open_streams[1])[-1].finish_reason == "length"
    assert list(stub.Generate(request, timeout=60))[-1].finish_reason == "length"
    wait_until(lambda: not servicer._per_client)


def test_http_callers_and_forwarded_clients_are_counted_by_their_own_address(pipeline):
    """Without API tokens the per-client limits count peer hosts. The HTTP gateway names its caller
    (`aerie-forwarded-for`), and the coordinator believes a trusted proxy (loopback by default): an
    HTTP caller bound to 127.0.0.2 is `peer ipv4:127.0.0.2`, not the gateway's 127.0.0.1, and a gRPC
    caller on loopback that forwards 203.0.113.9 is counted as that host (services/rpc/forwarded.py)."""
    import threading

    import httpx

    from gateway.server import start_http
    from services.rpc.forwarded import FORWARDED_FOR
    from tests.pipeline import HOST

    servicer = pipeline.coordinator.servicer
    http = pipeline.loop.run(start_http(pipeline.addresses["coordinator"], HOST, 0))
    gate = threading.Event()
    held = pipeline.verifier.batcher.exclusive(gate.wait)  # the streams stay open until the gate opens
    answers: list[int] = []

    def http_caller() -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as h:
            answers.append(h.post(f"http://{HOST}:{http.port}/v1/completions",
                                  json={"model": "target", "prompt": [1, 2, 3], "max_tokens": 4}).status_code)

    try:
        caller = threading.Thread(target=http_caller)
        caller.start()
        forwarded = pipeline.coordinator_stub().Generate(
            cpb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=4), timeout=60,
            metadata=((FORWARDED_FOR, "203.0.113.9"),))
        wait_until(lambda: servicer._per_client == {"peer ipv4:127.0.0.2": 1, "peer ipv4:203.0.113.9": 1})
    finally:
        gate.set()
    assert held is not None
    caller.join(60)
    assert answers == [200] and list(forwarded)[-1].finish_reason == "length"
    wait_until(lambda: not servicer._per_client)
    pipeline.loop.run(http.stop())
