"""Drafting ahead through the services (AERIE_OVERLAP): the coordinator's engine sends DraftAhead to
the drafter service while the Verify of the same round is in flight, over real gRPC and a real Redis.
Greedy output equals the target's greedy output; guesses that always hit or always miss give the
target's tokens and exact per-round counters (RoundStats.ahead / ahead_hit in the Generate stream);
a drafter or verifier that goes away in the middle of an overlapped round costs a rebuild, never a
token; a policy whose synthetic cost model says overlap cannot pay never drafts ahead. Every decision
here is count-based (contention fixed, learn_cost off): nothing depends on timing."""

import grpc
import pytest
import torch

from drafter_svc.load import DrafterLoad
from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import drafter as dpb
from services.spec.overlap import AheadPolicy
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, hf_greedy, oracle
from tests.pipeline import start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)
N = 40
DRAFT_DTYPE = "fp32"  # a refilled drafter grows the same trees (see tests/coordinator/test_failover.py)


def always() -> AheadPolicy:
    return AheadPolicy(contention=0.0, learn_cost=False)  # drafts ahead whenever a guess can hit


@pytest.fixture(scope="module")
def target_greedy(llama_pair):
    hf, _, _ = llama_pair
    return hf_greedy(hf, list(PROMPT), 100)  # the oracle looks up to a tree past the end


def stream(p, n: int = N, sampling: SamplingParams = SamplingParams()):
    """One sequence (greedy by default) through the coordinator: (tokens, its Generate messages)."""
    call = p.coordinator_stub().Generate(cpb.GenerateRequest(prompt_ids=list(PROMPT), max_new_tokens=n, ignore_eos=True,
                                                             sampling=codec.encode_sampling(sampling)), timeout=120)
    messages = list(call)
    return [t for m in messages for t in m.tokens], messages


def rounds(messages) -> list:
    return [m.stats for m in messages[1:]]  # (message 0 is the prefill round)


@pytest.fixture()
def pipeline(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, overlap="on")
    yield p
    p.close()


def counter(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"aerie_{name}_total", {"service": "coordinator"}) or 0.0


def test_overlap_is_on_by_config_and_greedy_equals_the_target(pipeline, target_greedy):
    assert pipeline.coordinator.sequences.ahead is not None  # AERIE_OVERLAP=1 (a learning policy)
    assert pipeline.coordinator.sequences.ahead.learn_cost
    pipeline.coordinator.sequences.ahead = always()
    before = counter("ahead_rounds"), counter("ahead_hits")
    tokens, messages = stream(pipeline)
    assert tokens == target_greedy[:N]
    stats = rounds(messages)
    # the top-path guess drafts ahead every tree round and hits in some
    assert sum(s.ahead for s in stats) > 0 and 0 < sum(s.ahead_hit for s in stats) <= sum(s.ahead for s in stats)
    assert all(s.ahead_s > 0 for s in stats if s.ahead)
    # the coordinator's counters (other tests in this process may add more, never fewer)
    assert counter("ahead_rounds") >= before[0] + sum(s.ahead for s in stats)
    assert counter("ahead_hits") >= before[1] + sum(s.ahead_hit for s in stats)
    wait_until(lambda: pipeline.drafter.drafter.num_sequences == 0 and pipeline.verifier.num_sequences == 0)


@pytest.mark.parametrize("hit", [True, False], ids=["always-hits", "always-misses"])
def test_injected_guess_gives_target_tokens_and_counters(pipeline, target_greedy, hit):
    pipeline.coordinator.sequences.ahead = always()
    pipeline.coordinator.sequences.guesser = oracle(target_greedy, hit)
    tokens, messages = stream(pipeline)
    assert tokens == target_greedy[:N]
    stats = rounds(messages)
    assert all(s.tree_size > 1 for s in stats)  # a fixed tree every round (the drafter's --tree-*)
    assert [s.ahead for s in stats] == [True] * len(stats)
    if hit:  # every round after the first verifies the tree drafted ahead: no draft waited for
        assert [s.ahead_hit for s in stats] == [False] + [True] * (len(stats) - 1)
        assert all(s.saved_s > 0 for s in stats[1:])
    else:
        assert not any(s.ahead_hit for s in stats) and all(s.saved_s == 0 for s in stats)


def test_seeded_sampling_with_overlap_replays(pipeline):
    """A seed gives the same tokens and the same ahead decisions again (sampling sequences decide
    with nominal seconds, never measured ones; each sequence starts from a fresh policy)."""
    pipeline.coordinator.sequences.ahead = AheadPolicy()  # the learning policy of AERIE_OVERLAP=1
    sampling = SamplingParams(0.9, top_p=0.95, seed=11)
    outs = []
    for _ in range(2):
        tokens, messages = stream(pipeline, 32, sampling)
        assert len(tokens) == 32 and all(0 <= t < VOCAB for t in tokens)
        outs.append((tokens, [(s.ahead, s.ahead_hit) for s in rounds(messages)]))
    assert outs[0] == outs[1]
    assert any(ahead for ahead, _ in outs[0][1])


def test_policy_that_cannot_pay_never_drafts_ahead(pipeline, target_greedy):
    # synthetic cost model: every second of an ahead draft lands on the critical path, so the
    # expected gain P(hit) * draft_s - 1.0 * (draft_s + j * step_s) is negative at every depth
    pipeline.coordinator.sequences.ahead = AheadPolicy(contention=1.0, learn_cost=False)
    tokens, messages = stream(pipeline, 24)
    assert tokens == target_greedy[:24]
    assert not any(s.ahead or s.ahead_hit for s in rounds(messages))


@pytest.fixture()
def pool(model_dirs, redis_url):
    """Two verifiers and two drafters behind one coordinator with overlap on."""
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE)
    v2, v2_server, v2_address = p.add_service("verifier", model_dirs)
    d2, d2_server, d2_address = p.add_service("drafter", model_dirs, draft_dtype=DRAFT_DTYPE)
    p.replicas = [(p.verifier, p.servers[0][0]), (v2, v2_server), (p.drafter, p.servers[1][0]), (d2, d2_server)]
    p.coordinator, p.addresses["coordinator"] = p.add_coordinator(
        redis_url, verifiers=(p.addresses["verifier"], v2_address), drafters=(p.addresses["drafter"], d2_address),
        probe_interval_s=60, verifier_wait_s=2, overlap="on")
    yield p
    p.close()


@pytest.mark.parametrize("hit", [True, False], ids=["guess-hits", "guess-misses"])
def test_drafter_then_verifier_go_away_in_an_overlapped_round(pool, target_greedy, hit):
    """The guesser runs when the round's tree is about to be verified and the ahead draft is about to
    start: there, the replica holding the sequence stops (in-flight calls fail, new ones are refused).
    Guess 3: the drafter (its DraftAhead fails over; the next draft moves the sequence and refills
    another drafter). Guess 7: the verifier (its Verify fails over and is rebuilt elsewhere while the
    DraftAhead runs on the drafter)."""
    oracle_guess = oracle(target_greedy, hit)
    calls = []

    def holder(role: str):
        for servicer, server in pool.replicas:
            held = servicer.drafter.num_sequences if hasattr(servicer, "drafter") else servicer.num_sequences
            if (role == "drafter") == hasattr(servicer, "drafter") and held:
                return servicer, server
        raise AssertionError(f"no {role} holds the sequence")

    def guesser(tree, depth, produced):
        calls.append(produced)
        if len(calls) == 3:
            pool.stop_server(holder("drafter")[1])
        if len(calls) == 7:
            pool.stop_server(holder("verifier")[1])
        return oracle_guess(tree, depth, produced)

    pool.coordinator.sequences.ahead = always()
    pool.coordinator.sequences.guesser = guesser
    tokens, messages = stream(pool, 60)
    assert tokens == target_greedy[:60]
    assert len(calls) >= 7
    assert [m.stats.round_index for m in messages] == list(range(len(messages)))
    state = pool.coordinator.store.get(messages[0].sequence_id)
    assert state.tokens == tokens and state.status == "finished"
    first = messages[0].info.placement
    assert state.drafter not in ("", first.drafter) and state.verifier != first.verifier
    stats = rounds(messages)
    assert sum(s.ahead for s in stats) > 0
    if hit:  # the rounds right after the drafter's failed DraftAhead draft afresh; the others hit
        assert 0 < sum(s.ahead_hit for s in stats) < len(stats)


def test_draft_ahead_rpc_is_idempotent_and_validated(pipeline):
    """The DraftAhead RPC itself: the ahead tree is rooted at the guess's last token, a repeated
    call (a retry) returns the same tree without touching the draft KV again, and a bad guess gets
    INVALID_ARGUMENT naming the limit."""
    stub = pipeline.drafter_stub()
    drafter = pipeline.drafter.drafter
    f = drafter.head.config.feature_size
    tree = codec.encode_tree_params(TreeParams(4, 3, 16))
    stub.Prefill(iter([dpb.DrafterPrefillRequest(sequence_id="s", max_rows=64, tokens=[4, 9, 21],
                                                 features=codec.encode_tensor(torch.randn(3, f)), tree=tree)]),
                 timeout=60)
    length = drafter._caches["s"].length
    request = dpb.DraftAheadRequest(sequence_id="s", round_index=2, tokens=[30], guess=[31, 7],
                                    features=codec.encode_tensor(torch.randn(1, f)), tree=tree)
    first = stub.DraftAhead(request, timeout=60)
    ahead = codec.decode_tree(first.tree, VOCAB)
    # the drafter's default: two branches (likely bonuses), a fresh-sized subtree under each
    assert int(ahead.tokens[0]) == 7 and ahead.size == 1 + 2 * 16
    assert drafter._caches["s"].length == length + 1  # the committed row stays, the guessed rows do not
    assert stub.DraftAhead(request, timeout=60) == first  # a retry: the same tree, the KV untouched
    assert drafter._caches["s"].length == length + 1
    for guess, match in (([], "guess must hold 1 to 5"), ([1] * 6, "guess must hold 1 to 5"),
                         ([VOCAB], "outside the vocabulary")):
        bad = dpb.DraftAheadRequest(sequence_id="s", round_index=3, guess=guess)
        with pytest.raises(grpc.RpcError) as e:
            stub.DraftAhead(bad, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
    one = dpb.DraftAheadRequest(sequence_id="s", round_index=3, guess=[31, 7], tree=tree, branches=0)
    assert codec.decode_tree(stub.DraftAhead(one, timeout=60).tree, VOCAB).size == 16  # one tree of the shape
    skip = int(ahead.tokens[1])  # the first branch, excluded: no branch holds it any more
    ex = dpb.DraftAheadRequest(sequence_id="s", round_index=4, guess=[31, 7], tree=tree, exclude=[skip],
                               exclude_sizes=[1], chain=[9])
    ahead = codec.decode_tree(stub.DraftAhead(ex, timeout=60).tree, VOCAB)
    assert int(ahead.tokens[1]) == 9 and int(ahead.parents[1]) == 0  # the chain
    assert skip not in [int(ahead.tokens[i]) for i in range(2, ahead.size) if int(ahead.parents[i]) == 0]
    assert ahead.size == 2 + 2 * 2 * 16  # two branches at the root and at the chain node
    for field, match in (({"branches": -1}, "branches must be >= 0"),
                         ({"exclude": [VOCAB], "exclude_sizes": [1]}, "outside the vocabulary"),
                         ({"exclude": [3]}, "exclude_sizes must split the 1 exclude tokens"),
                         ({"exclude": [3, 4], "exclude_sizes": [1, 1]}, "into at most 1 lists"),
                         ({"chain": [1] * 5}, "chain must hold at most 4 tokens")):
        bad = dpb.DraftAheadRequest(sequence_id="s", round_index=5, guess=[3], **field)
        with pytest.raises(grpc.RpcError) as e:
            stub.DraftAhead(bad, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.DraftAhead(dpb.DraftAheadRequest(sequence_id="nope", round_index=2, guess=[3]), timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_busy_drafter_drafts_ahead_less(pipeline, target_greedy):
    """The drafter reports its load (DraftResponse.busy: the share of its last second spent on OTHER
    sequences' batches) and the coordinator's policy takes it as contention. A synthetic load on an
    explicit clock: another sequence filled the last second -> busy 1.0 -> no ahead draft at all;
    the same drafter idle -> ahead drafts again. No timing: the clock never moves."""
    servicer = pipeline.drafter
    servicer.load = DrafterLoad(window_s=1.0, clock=lambda: 100.0)
    servicer.load.ran(99.0, 100.0, {"someone-else"})  # the synthetic load
    f = servicer.drafter.head.config.feature_size
    prefill = dpb.DrafterPrefillRequest(sequence_id="b", max_rows=64, tokens=[4, 9],
                                        features=codec.encode_tensor(torch.randn(2, f)))
    assert pipeline.drafter_stub().Prefill(iter([prefill]), timeout=60).busy == 1.0
    pipeline.drafter_stub().Release(pb.ReleaseRequest(sequence_id="b"), timeout=60)
    servicer.load.ran(99.5, 100.0, {"b"})  # its own batches are no load for a sequence
    assert servicer.load.busy("b") == 1.0 and servicer.load.busy("someone-else") == 0.5
    pipeline.coordinator.sequences.ahead = always()  # contention 0: only the load can stop it
    tokens, messages = stream(pipeline, 24)
    assert tokens == target_greedy[:24]
    assert not any(s.ahead for s in rounds(messages))
    servicer.load = DrafterLoad(window_s=1.0, clock=lambda: 100.0)  # idle
    tokens, messages = stream(pipeline, 24)
    assert tokens == target_greedy[:24]
    assert any(s.ahead for s in rounds(messages))

