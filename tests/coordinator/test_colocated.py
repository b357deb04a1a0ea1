"""A verifier that drafts too (`aerie verifier --draft`, `aerie up --colocate`): the head in the
verifier's process, its Drafter service on the same port, and each tree round's Verify drafting the
next tree from its verdict (VerifyRequest.next_draft): one call a round instead of a Verify and a
Draft. Over real gRPC and a real Redis: greedy output equals the target's; the trees, acceptance and
seeded samples equal the split pipeline's (a fixed tree: the same Draft calls, made in another
place; plans that change the shape: tests/engine/test_draft_in_verify.py); a colocated verifier that dies moves
the sequence, which drafts inside the Verify again on the replacement; a bad next_draft gets
INVALID_ARGUMENT and a repeated Verify the same next tree. Round 1's tree comes with the Prefill
(VerifierPrefillRequest.next_draft), chunked or not. Nothing here depends on timing."""

import itertools

import grpc
import pytest
import torch

from services.rpc import codec
from services.rpc.stubs import coordinator as cpb
from services.rpc.stubs import verifier as vpb
from services.spec.sampling import SamplingParams
from services.spec.tree import TreeParams
from tests.helpers import VOCAB, hf_greedy
from tests.pipeline import TREE, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)
N = 40
DRAFT_DTYPE = "fp32"  # a refilled drafter grows the same trees (tests/coordinator/test_failover.py)


@pytest.fixture(scope="module")
def target_greedy(llama_pair):
    hf, _, _ = llama_pair
    return hf_greedy(hf, list(PROMPT), 2 * N)


def generate(p, n: int = N, sampling: SamplingParams = SamplingParams(), on_message=None):
    """One sequence through the coordinator: (tokens, its Generate messages); `on_message(i)` runs
    after message i arrives."""
    call = p.coordinator_stub().Generate(cpb.GenerateRequest(prompt_ids=list(PROMPT), max_new_tokens=n, ignore_eos=True,
                                                             sampling=codec.encode_sampling(sampling)), timeout=120)
    messages = []
    for m in call:
        messages.append(m)
        if on_message is not None:
            on_message(len(messages) - 1)
    return [t for m in messages for t in m.tokens], messages


def rounds(messages) -> list:
    return [m.stats for m in messages[1:]]  # (message 0 is the prefill round)


def counter(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"aerie_{name}_total", {"service": "coordinator"}) or 0.0


def prefill_calls() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("aerie_prefill_seconds_count", {"service": "verifier"}) or 0.0


@pytest.fixture(scope="module")
def split(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE)
    yield p
    p.close()


@pytest.fixture(scope="module")
def colocated(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, colocate=True)
    yield p
    p.close()


def test_greedy_equals_the_target_and_the_split_pipeline(colocated, split, target_greedy):
    before, runs_before = counter("drafts_in_verify"), counter("tree_run_rounds")
    tokens, messages = generate(colocated)
    assert tokens == target_greedy[:N]
    assert messages[0].info.placement.drafter == messages[0].info.placement.verifier == colocated.addresses["verifier"]
    stats = rounds(messages)
    assert all(s.tree_size > 1 for s in stats)  # the fixed tree every round
    # the first round's tree comes with the Prefill (drafted in the verifier's process); every later one from
    # the Verify before it, but near the end: a round that may end the request (TREE.depth + 2 = 5 tokens or
    # fewer left) drafts nothing
    left = [N - len(messages[0].tokens) - sum(s.accept_length for s in stats[:i]) for i in range(len(stats))]
    assert [s.drafted_in_verify for s in stats] == [True] + [n > TREE.depth + 2 for n in left[:-1]]
    assert counter("drafts_in_verify") == before + sum(s.drafted_in_verify for s in stats) > before
    # and the rounds ran as a run of tree rounds in the verifier (VerifyRun, up to 16 a call: the
    # coordinator's --plain-run), from the first until the run's tokens reach what leaves a round that
    # may end the request (those rounds are single Verify calls); the same trees as one call each
    limit, made, in_run = N - len(messages[0].tokens) - (TREE.depth + 2), 0, 0
    for s in stats:
        if made >= limit:
            break
        made, in_run = made + s.accept_length, in_run + 1
    assert 1 < in_run < len(stats) and counter("tree_run_rounds") == runs_before + in_run
    split_tokens, split_messages = generate(split)
    assert split_tokens == tokens
    assert not any(s.drafted_in_verify for s in rounds(split_messages))
    # the same Draft calls, made in the verifier's process: the same trees, so the same acceptance
    assert [(s.tree_size, s.accept_length) for s in rounds(split_messages)] == [(s.tree_size, s.accept_length)
                                                                                for s in stats]
    wait_until(lambda: colocated.verifier.num_sequences == 0 and colocated.drafter.drafter.num_sequences == 0)


def test_a_prompt_sent_in_chunks_gets_round_ones_tree_with_its_last_chunk(model_dirs, redis_url, target_greedy):
    """A verifier whose prefill chunk (4 rows) is shorter than the prompt: the coordinator sends the
    prompt in two calls, both asking for round 1's tree; it comes with the second, and the output is
    the target's."""
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, colocate=True,
                       verifier_overrides={"prefill_chunk": 4})
    try:
        calls = prefill_calls()
        tokens, messages = generate(p, 12)
        assert tokens == target_greedy[:12] and prefill_calls() == calls + 2  # (two chunks)
        assert rounds(messages)[0].drafted_in_verify and rounds(messages)[0].tree_size == TREE.size
    finally:
        p.close()


def test_the_head_uses_the_verifiers_lm_head(colocated):
    """Nothing of the target is read twice: the head projects through the verifier's own lm_head (as
    the in-process engine's head does; a drafter process reads it from the checkpoint)."""
    head = colocated.drafter.drafter.head  # an EAGLE-2 head holds its target's lm_head by reference
    assert head._target_head[0] is colocated.verifier.target.lm_head


def test_short_runs_follow_each_other(model_dirs, redis_url, target_greedy):
    """--plain-run 2: runs of two tree rounds, each followed at once by the next run (no single Verify
    between them): every round before the request's last few is a run's."""
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, colocate=True, plain_run=2)
    try:
        before = counter("tree_run_rounds")
        tokens, messages = generate(p)
        assert tokens == target_greedy[:N]
        stats = rounds(messages)
        limit, made, in_run = N - len(messages[0].tokens) - (TREE.depth + 2), 0, 0
        for s in stats:
            if made >= limit:
                break
            made, in_run = made + s.accept_length, in_run + 1
        assert in_run > 4 and counter("tree_run_rounds") == before + in_run
    finally:
        p.close()


def test_seeded_sampling_equals_the_split_pipeline(colocated, split):
    """The round's random draws depend on the seed and the round only, and the trees are the same:
    the tokens a seed gives through the split pipeline (whose sampling passes the chi-square test,
    tests/spec) come out again, and again on a second run."""
    sampling = SamplingParams(0.9, top_p=0.95, seed=11)
    runs = [generate(colocated, 32, sampling)[0] for _ in range(2)]
    assert runs[0] == runs[1] == generate(split, 32, sampling)[0]
    assert len(runs[0]) == 32 and all(0 <= t < VOCAB for t in runs[0])


@pytest.fixture()
def pair(model_dirs, redis_url):
    """Two verifiers that draft too behind one coordinator (each its own drafter pool entry)."""
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, colocate=True)
    v2, v2_server, v2_address = p.add_service("verifier", model_dirs, draft_dtype=DRAFT_DTYPE, colocate=True)
    p.replicas = [(p.verifier, p.servers[0][0]), (v2, v2_server)]
    both = (p.addresses["verifier"], v2_address)
    p.coordinator, p.addresses["coordinator"] = p.add_coordinator(redis_url, verifiers=both, drafters=both,
                                                                  probe_interval_s=60, verifier_wait_s=2)
    yield p
    p.close()


def test_a_colocated_verifier_that_dies_moves_the_sequence_and_it_drafts_in_verify_again(pair, target_greedy):
    """The process holding both the sequence's KV and its draft KV stops after round 4: the Verify
    fails over (rebuilt on the other verifier), the next draft finds its drafter gone and refills the
    drafter of the new verifier's process (placement prefers it), and the rounds after that draft
    inside the Verify again. No token is lost or changed."""
    def stop_holder(i: int) -> None:
        if i == 4:
            server = next(server for servicer, server in pair.replicas if servicer.num_sequences)
            pair.stop_server(server)

    # 2N tokens: rounds are left after the stop wherever it lands (the coordinator may be a round or two
    # ahead of the stream, more with runs)
    tokens, messages = generate(pair, 2 * N, on_message=stop_holder)
    assert tokens == target_greedy
    first = messages[0].info.placement
    state = pair.coordinator.store.get(messages[0].sequence_id)
    assert state.status == "finished" and state.tokens == tokens
    assert state.verifier != first.verifier and state.drafter == state.verifier  # moved together
    stats = rounds(messages)
    # one round after the move drafts through the Draft call (the retried Verify went to another
    # process); later rounds draft inside the Verify again (which round that is depends on where the
    # stop landed: the coordinator may be a round ahead of the stream)
    moved = next(i for i in range(1, len(stats)) if not stats[i].drafted_in_verify)
    assert any(s.drafted_in_verify for s in stats[moved + 1:])


def test_next_draft_is_validated_and_a_repeated_verify_returns_the_same_tree(colocated, split):
    """The Verify's next_draft itself: a verifier without a head refuses it, a shape the head cannot
    grow is refused naming its limit, and a retry returns the same next tree (the draft KV untouched)."""
    stub = colocated.verifier_stub()
    prefill = vpb.VerifierPrefillRequest(sequence_id="v", prompt_ids=list(PROMPT), capacity=128,
                                         feature_kind=codec.WIRE_FEATURE_KINDS["hidden"])
    first = list(stub.Prefill(prefill, timeout=60))
    features = codec.decode_tensor(first[0].features, "features", shape=(len(PROMPT), None))
    root = first[0].first_token
    # the draft KV of "v" as the coordinator's first draft makes it (prompt[1:] + the first token)
    head = colocated.drafter.drafter  # (the servicer's Drafter, called in process: nothing else runs now)
    head.start("v", 128, False)
    drafted = head.draft("v", torch.tensor([*PROMPT[1:], root]), features, TREE)
    request = vpb.VerifyRequest(sequence_id="v", round_index=1, tree=codec.encode_tree(drafted))
    request.next_draft.round_index = 2
    request.next_draft.tree.CopyFrom(codec.encode_tree_params(TREE))
    answer = stub.Verify(request, timeout=60)
    assert answer.HasField("next_tree") and answer.next_draft_seconds > 0
    next_tree = codec.decode_tree(answer.next_tree, VOCAB)
    assert int(next_tree.tokens[0]) == answer.bonus and next_tree.size == TREE.size
    # the head took the features in the verifier's process: none travel back
    assert codec.decode_tensor(answer.features, "features", shape=(None, None)).shape[0] == 0
    length = colocated.drafter.drafter._caches["v"].length
    assert untimed(stub.Verify(request, timeout=60)) == untimed(answer)  # a retry: the same verdict and next tree
    assert colocated.drafter.drafter._caches["v"].length == length
    bad = vpb.VerifyRequest(sequence_id="v", round_index=2, tree=answer.next_tree)
    bad.next_draft.round_index = 3
    bad.next_draft.tree.CopyFrom(codec.encode_tree_params(TreeParams(64, 3, 16)))
    with pytest.raises(grpc.RpcError) as e:
        stub.Verify(bad, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in e.value.details()
    assert untimed(stub.Verify(request, timeout=60)) == untimed(answer)  # refused before it ran: round 1 is the latest
    stub.Release(_release("v"), timeout=60)
    colocated.drafter.drafter.release("v")
    plain = split.verifier_stub()
    list(plain.Prefill(vpb.VerifierPrefillRequest(sequence_id="w", prompt_ids=list(PROMPT), capacity=128,
                                                  feature_kind=codec.WIRE_FEATURE_KINDS["hidden"]), timeout=60))
    ask = vpb.VerifyRequest(sequence_id="w", round_index=1, tree=codec.encode_tree(drafted))
    ask.next_draft.round_index = 2
    with pytest.raises(grpc.RpcError) as e:
        plain.Verify(ask, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--draft" in e.value.details()
    plain.Release(_release("w"), timeout=60)


def _prefill_drafting(seq_id: str, chunk: int = 0, round_index: int = 1) -> list[vpb.VerifierPrefillRequest]:
    """The Prefill calls of PROMPT for `seq_id` that ask for round 1's tree (next_draft), in chunks of
    `chunk` rows (0: one call)."""
    chunk = chunk or len(PROMPT)
    calls = []
    for offset in range(0, len(PROMPT), chunk):
        part = PROMPT[offset:offset + chunk]
        request = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=list(part), capacity=128,
                                             feature_kind=codec.WIRE_FEATURE_KINDS["hidden"], offset=offset,
                                             more=offset + len(part) < len(PROMPT), prompt_tokens=len(PROMPT))
        request.next_draft.round_index = round_index
        request.next_draft.tree.CopyFrom(codec.encode_tree_params(TREE))
        calls.append(request)
    return calls


def _rows(answer: list[vpb.VerifierPrefillResponse]) -> int:
    return codec.decode_tensor(answer[0].features, "features", shape=(None, None)).shape[0]


def test_round_one_is_drafted_in_the_prefill(colocated, split):
    """VerifierPrefillRequest.next_draft on a verifier that drafts too: the answer carries round 1's
    tree, the one the coordinator's Prefill to the head would have drafted, and no features (they
    stayed in the process); chunk by chunk, every chunk asks and answers without features, the last
    one with the tree; a last chunk sent again gets the same tree (the draft KV untouched); a draft
    that fails (the head holds the id already) answers with every row's features; bad requests are
    refused naming the value."""
    stub = colocated.verifier_stub()
    head = colocated.drafter.drafter
    for chunk in (0, 2, 4):
        # the tree the coordinator's first draft makes from a plain prefill's features (chunked alike)
        plain = []
        for request in _prefill_drafting(f"p{chunk}", chunk):
            request.ClearField("next_draft")
            plain += list(stub.Prefill(request, timeout=60))
        features = torch.cat([codec.decode_tensor(m.features, "features", shape=(None, None)) for m in plain])
        first_token = plain[-1].first_token
        head.start(f"p{chunk}", 128, False)
        expected = head.draft(f"p{chunk}", torch.tensor([*PROMPT[1:], first_token]), features, TREE)
        seq_id = f"f{chunk}"
        answers = [list(stub.Prefill(request, timeout=60)) for request in _prefill_drafting(seq_id, chunk)]
        assert all(_rows(a) == 0 and not a[0].HasField("next_tree") for a in answers[:-1])
        last = answers[-1]
        assert last[0].first_token == first_token and _rows(last) == 0
        assert last[0].HasField("next_tree") and last[0].next_draft_seconds > 0
        tree = codec.decode_tree(last[0].next_tree, VOCAB)
        assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.parents, expected.parents)
        assert head._caches[seq_id].length == len(PROMPT)  # prompt[1:] and the first token
    # the last chunk sent again (its deadline missed): the same tree, nothing drafted twice
    again = list(stub.Prefill(_prefill_drafting("f4", 4)[-1], timeout=60))
    assert again[0].next_tree == last[0].next_tree and head._caches["f4"].length == len(PROMPT)
    # a draft that fails: the head holds "x" already; every row's features come with the last chunk
    head.start("x", 128, False)
    answers = [list(stub.Prefill(request, timeout=60)) for request in _prefill_drafting("x", 4)]
    assert _rows(answers[0]) == 0 and not answers[-1][0].HasField("next_tree") and _rows(answers[-1]) == len(PROMPT)
    got = codec.decode_tensor(answers[-1][0].features, "features", shape=(len(PROMPT), None))
    assert torch.equal(got, features)  # (the same chunks as p4's)
    # that answer (every row's features) is kept for the last chunk sent again, until the first round
    assert "x" in colocated.verifier._first._done
    stub.Decode(vpb.DecodeRequest(sequence_id="x", round_index=1, token=answers[-1][0].first_token), timeout=60)
    assert "x" not in colocated.verifier._first._done
    for seq_id in ("p0", "p2", "p4", "f0", "f2", "f4", "x"):
        stub.Release(_release(seq_id), timeout=60)
        head.release(seq_id)
    # refused before anything runs: next_draft on a later chunk only, index 0, no head
    first, later = _prefill_drafting("f5", 3)
    first.ClearField("next_draft")
    list(stub.Prefill(first, timeout=60))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Prefill(later, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "was not on the chunk at offset 0" in e.value.details()
    stub.Release(_release("f5"), timeout=60)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Prefill(_prefill_drafting("f6", round_index=0)[0], timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "round_index must be >= 1" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(split.verifier_stub().Prefill(_prefill_drafting("f7")[0], timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--draft" in e.value.details()
    assert colocated.verifier.num_sequences == 0 and split.verifier.num_sequences == 0


def untimed(answer: vpb.VerifyResponse) -> vpb.VerifyResponse:
    """The answer without what is measured when it is answered (a replay's seconds and the drafter's load)."""
    out = vpb.VerifyResponse()
    out.CopyFrom(answer)
    out.next_draft_seconds, out.drafter_busy, out.verify_seconds = 0.0, 0.0, 0.0
    out.ahead_seconds, out.ahead_wait_seconds = 0.0, 0.0
    return out


def _release(seq_id: str):
    from services.rpc.stubs import common as pb

    return pb.ReleaseRequest(sequence_id=seq_id)


def verify_run_request(p, seq_id: str, rounds: int, max_tokens: int) -> tuple[vpb.VerifyRunRequest, torch.Tensor]:
    """`seq_id` prefilled on `p`'s verifier that drafts too, its head started and its first tree drafted
    there: (the VerifyRun request of its first round, the prompt's features [len(PROMPT), F])."""
    prefill = vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=list(PROMPT), capacity=128,
                                         feature_kind=codec.WIRE_FEATURE_KINDS["hidden"])
    first = list(p.verifier_stub().Prefill(prefill, timeout=60))
    features = codec.decode_tensor(first[0].features, "features", shape=(len(PROMPT), None))
    head = p.drafter.drafter
    head.start(seq_id, 128, False)
    tree = head.draft(seq_id, torch.tensor([*PROMPT[1:], first[0].first_token]), features, TREE)
    request = vpb.VerifyRunRequest(sequence_id=seq_id, round_index=1, tree=codec.encode_tree(tree), rounds=rounds,
                                   max_tokens=max_tokens)
    request.next_draft.round_index = 2
    request.next_draft.tree.CopyFrom(codec.encode_tree_params(TREE))
    return request, features


def test_verify_run_chains_rounds_and_a_verify_repeats_any_of_them(colocated, split):
    """The VerifyRun call itself: each round verifies the tree drafted in the round before, answers
    carry their round and next tree, the run stops at max_tokens; a Verify at any round it ran gets that
    round's answer again (a broken stream's retry), and bad requests are refused naming the value."""
    stub = colocated.verifier_stub()
    request, _ = verify_run_request(colocated, "r", 8, 6)
    head = colocated.drafter.drafter
    answers = list(stub.VerifyRun(request, timeout=60))
    made = [len(a.tokens) for a in answers]  # (tokens[1:] and the bonus: as many as tokens)
    assert [a.round_index for a in answers] == list(range(1, len(answers) + 1))
    assert sum(made[:-1]) < 6 <= sum(made) and all(a.HasField("next_tree") for a in answers)
    for a, b in itertools.pairwise(answers):  # each round verified the tree the round before drafted
        assert b.tokens[0] == a.bonus and codec.decode_tree(a.next_tree, VOCAB).tokens[0] == a.bonus
    again = vpb.VerifyRequest(sequence_id="r", round_index=len(answers), tree=answers[-2].next_tree) \
        if len(answers) > 1 else vpb.VerifyRequest(sequence_id="r", round_index=1, tree=request.tree)
    assert stub.Verify(again, timeout=60) == answers[-1]  # a retry: the run's answer, never run twice
    with pytest.raises(grpc.RpcError) as e:
        stub.Decode(vpb.DecodeRequest(sequence_id="r", round_index=len(answers), token=5), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree round of a run" in e.value.details()
    for field, value, match in (("rounds", 0, "steps must be in [1, 64]"), ("max_tokens", 0, "max_tokens must be >= 1")):
        bad = vpb.VerifyRunRequest()
        bad.CopyFrom(request)
        setattr(bad, field, value)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.VerifyRun(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
    stub.Release(_release("r"), timeout=60)
    head.release("r")
    with pytest.raises(grpc.RpcError) as e:
        list(split.verifier_stub().VerifyRun(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--draft" in e.value.details()

