"""Direct drafts (coordinator --direct-drafts, verifier_svc/direct_draft.py): the verifier sends each
verdict's Draft straight to the sequence's drafter in another process and answers with the next tree,
one Verify call an EAGLE round (and runs of tree rounds: VerifyRun). Over real gRPC
servers and a real Redis: greedy output equals the target's and the trees, acceptance and seeded
samples equal the split pipeline's (the same Draft calls, sent from another place); a drafter that
stops mid-run moves the sequence and its rounds draft directly again at the new drafter; an
unreachable drafter leaves the answer a plain Verify's (the coordinator drafts); bad values are
refused naming them. Nothing here depends on timing."""

import grpc
import pytest
import torch

from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import drafter as dpb
from services.rpc.stubs import verifier as vpb
from services.spec.sampling import SamplingParams
from tests.coordinator.test_colocated import (DRAFT_DTYPE, N, PROMPT, _prefill_drafting, colocated,  # noqa: F401
                                             counter, generate, rounds, split, target_greedy, untimed)
from tests.helpers import VOCAB
from tests.pipeline import TREE, start_pipeline, wait_until


def direct_counter(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("aerie_direct_drafts_total", {"service": "verifier", "outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def direct(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True)
    yield p
    p.close()


def in_run(messages, n: int = N) -> int:
    """The rounds a run of tree rounds can have answered: from the first, until the run's tokens reach
    what leaves a round that may end the request (those are single Verify calls)."""
    limit, made, count = n - len(messages[0].tokens) - (TREE.depth + 2), 0, 0
    for s in rounds(messages):
        if made >= limit:
            break
        made, count = made + s.accept_length, count + 1
    return count


def test_greedy_equals_the_target_and_the_split_pipeline(direct, split, target_greedy):
    before, runs_before, drafted_before = counter("drafts_in_verify"), counter("tree_run_rounds"), direct_counter("drafted")
    tokens, messages = generate(direct)
    assert tokens == target_greedy[:N]
    placement = messages[0].info.placement
    assert (placement.drafter, placement.verifier) == (direct.addresses["drafter"], direct.addresses["verifier"])
    stats = rounds(messages)
    assert all(s.tree_size > 1 for s in stats)
    # every round's tree was drafted by the drafter process at the verifier's request (the first one by
    # the drafter's Prefill the verifier sent it with the prompt's features), but near the end (a round
    # that may end the request drafts nothing)
    left = [N - len(messages[0].tokens) - sum(s.accept_length for s in stats[:i]) for i in range(len(stats))]
    assert [s.drafted_in_verify for s in stats] == [True] + [n > TREE.depth + 2 for n in left[:-1]]
    drafted = sum(s.drafted_in_verify for s in stats)
    assert counter("drafts_in_verify") == before + drafted and direct_counter("drafted") == drafted_before + drafted
    assert 1 < in_run(messages) < len(stats) and counter("tree_run_rounds") == runs_before + in_run(messages)
    split_tokens, split_messages = generate(split)
    assert split_tokens == tokens and not any(s.drafted_in_verify for s in rounds(split_messages))
    assert [(s.tree_size, s.accept_length) for s in rounds(split_messages)] == [(s.tree_size, s.accept_length)
                                                                                for s in stats]
    wait_until(lambda: direct.verifier.num_sequences == 0 and direct.drafter.drafter.num_sequences == 0)


def test_the_verifiers_channels_to_drafters_close_and_open_again(direct, target_greedy):
    """At its stop a verifier closes the channels its direct drafts opened (aerie_cli/serve.py on_stop);
    a direct draft after that opens them again."""
    generate(direct, 16)
    drafts = direct.verifier._direct
    assert drafts is not None and drafts._stubs
    channels = [channel for channel, _ in drafts._stubs.values()]
    direct.loop.run(direct.verifier.close_channels())
    assert direct.verifier._direct is None and not drafts._stubs
    assert all(c.get_state() == grpc.ChannelConnectivity.SHUTDOWN for c in channels)
    before = direct_counter("drafted")
    tokens, _ = generate(direct)
    assert tokens == target_greedy[:N] and direct_counter("drafted") > before


def test_seeded_sampling_equals_the_split_pipeline(direct, split):
    sampling = SamplingParams(0.9, top_p=0.95, seed=11)
    runs = [generate(direct, 32, sampling)[0] for _ in range(2)]
    assert runs[0] == runs[1] == generate(split, 32, sampling)[0]


def test_single_verify_calls_without_runs(model_dirs, redis_url, target_greedy):
    """--plain-run 0: one Verify a round, each drafting the next tree at the drafter."""
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True, plain_run=0)
    try:
        runs_before = counter("tree_run_rounds")
        tokens, messages = generate(p)
        assert tokens == target_greedy[:N]
        assert counter("tree_run_rounds") == runs_before and sum(s.drafted_in_verify for s in rounds(messages)) > 3
    finally:
        p.close()


@pytest.fixture(params=["serial", "ahead"])
def two_drafters(model_dirs, redis_url, request):
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE)
    d2, d2_server, d2_address = p.add_service("drafter", model_dirs, draft_dtype=DRAFT_DTYPE)
    p.replicas = [(p.drafter, p.servers[1][0]), (d2, d2_server)]
    p.coordinator, p.addresses["coordinator"] = p.add_coordinator(
        redis_url, drafters=(p.addresses["drafter"], d2_address), probe_interval_s=60, direct_drafts=True,
        overlap="always" if request.param == "ahead" else "off")
    p.mode = request.param
    yield p
    p.close()


def test_a_drafter_that_stops_mid_run_moves_the_sequence_and_it_drafts_directly_again(two_drafters, target_greedy):
    """The sequence's drafter stops after round 4 (inside a run of tree rounds): the verifier's Draft
    to it fails, the run ends with a round without a next tree, the coordinator's Draft call fails
    over to the other drafter (refilled from the committed tokens), and the verifier drafts there
    from then on. No token is lost or changed. `ahead` (runs that draft ahead at the verifier,
    verifier_svc/ahead_run.py): whichever call meets the stopped drafter (the verifier's DraftAhead or
    Draft, or the coordinator's), the sequence moves, and its runs draft ahead at the other drafter."""
    p = two_drafters
    failed_before = direct_counter("failed")

    def stop_holder(i: int) -> None:
        if i == 4:
            server = next(server for servicer, server in p.replicas if servicer.drafter.num_sequences)
            p.stop_server(server)

    tokens, messages = generate(p, 2 * N, on_message=stop_holder)
    assert tokens == target_greedy
    state = p.coordinator.store.get(messages[0].sequence_id)
    assert state.status == "finished" and state.drafter != messages[0].info.placement.drafter
    stats = rounds(messages)
    moved = next(i for i in range(1, len(stats)) if not stats[i].drafted_in_verify)
    assert any(s.drafted_in_verify for s in stats[moved + 1:])
    if p.mode == "serial":  # (ahead: the stop may land between two short runs, on the coordinator's own call)
        assert direct_counter("failed") > failed_before
    else:  # drafting ahead before the stop and after the move
        assert any(s.ahead for s in stats[:moved]) and any(s.ahead_hit for s in stats[moved + 1:])


def _verifier_sequence(p, seq_id: str):
    """A sequence prefilled on `p`'s verifier and its drafter (as the coordinator's first draft makes
    it), called directly: (the verifier stub, the first tree)."""
    stub = p.verifier_stub()
    first = list(stub.Prefill(vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=list(PROMPT), capacity=128,
                                                         feature_kind=codec.WIRE_FEATURE_KINDS["hidden"]), timeout=60))
    features = codec.decode_tensor(first[0].features, "features", shape=(len(PROMPT), None))
    head = p.drafter.drafter
    head.start(seq_id, 128, False)
    return stub, head.draft(seq_id, torch.tensor([*PROMPT[1:], first[0].first_token]), features, TREE)


def unused_port() -> int:
    """A loopback port nothing listens at (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_direct_next_draft_is_validated_replayed_and_survives_an_unreachable_drafter(split):
    stub, tree = _verifier_sequence(split, "d")
    head = split.drafter.drafter
    request = vpb.VerifyRequest(sequence_id="d", round_index=1, tree=codec.encode_tree(tree))
    for drafter, index, match in (("nowhere", 2, "next_draft.drafter must be host:port"),
                                  ("127.0.0.1:99999", 2, "next_draft.drafter must be host:port"),
                                  (split.addresses["drafter"], 1, "next_draft.round_index must be >= 2")):
        bad = vpb.VerifyRequest()
        bad.CopyFrom(request)
        bad.next_draft.round_index, bad.next_draft.drafter = index, drafter
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(bad, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
        assert repr(drafter)[:20] in e.value.details() or str(index) in e.value.details()
    # a drafter nobody listens at: the answer is a plain Verify's (the features come back, no tree)
    gone = vpb.VerifyRequest()
    gone.CopyFrom(request)
    gone.next_draft.round_index, gone.next_draft.drafter = 2, f"127.0.0.1:{unused_port()}"
    answer = stub.Verify(gone, timeout=60)
    assert not answer.HasField("next_tree")
    assert codec.decode_tensor(answer.features, "features", shape=(None, None)).shape[0] == len(answer.tokens)
    # the repeated Verify names the live drafter: the stored verdict, now drafted there
    request.next_draft.round_index, request.next_draft.drafter = 2, split.addresses["drafter"]
    request.next_draft.tree.CopyFrom(codec.encode_tree_params(TREE))
    drafted = stub.Verify(request, timeout=60)
    assert (drafted.bonus, list(drafted.tokens)) == (answer.bonus, list(answer.tokens))
    next_tree = codec.decode_tree(drafted.next_tree, VOCAB)
    assert int(next_tree.tokens[0]) == drafted.bonus and next_tree.size == TREE.size
    assert codec.decode_tensor(drafted.features, "features", shape=(None, None)).shape[0] == 0
    length = head._caches["d"].length
    assert untimed(stub.Verify(request, timeout=60)) == untimed(drafted)  # a retry: the same tree
    assert head._caches["d"].length == length  # the draft ran once
    stub.Release(pb.ReleaseRequest(sequence_id="d"), timeout=60)
    head.release("d")


def test_round_one_is_drafted_at_the_drafter_the_prefill_names(split):
    """A Prefill whose next_draft names the sequence's drafter: the verifier sends that drafter its
    Prefill (the prompt's features) and answers with round 1's tree, the one the coordinator's own
    Prefill to the drafter gives, and no features; the drafter's Prefill sent again at the same
    index (a retry) gets the same tree, its KV untouched; an unreachable drafter leaves every row's
    features in the answer; a bad address is refused before the prefill runs."""
    stub, expected = _verifier_sequence(split, "g0")  # (the coordinator's way: a plain prefill, then the head)
    head = split.drafter.drafter
    trees = {}
    for seq_id, chunk in (("g1", 0), ("g2", 4)):
        answers = [list(stub.Prefill(r, timeout=60)) for r in direct_prefill(seq_id, split.addresses["drafter"], chunk)]
        assert all(not a[0].HasField("next_tree") for a in answers[:-1]) and answers[-1][0].HasField("next_tree")
        assert all(codec.decode_tensor(a[0].features, "features", shape=(None, None)).shape[0] == 0 for a in answers)
        tree = codec.decode_tree(answers[-1][0].next_tree, VOCAB)
        if not chunk:  # (a chunked prefill's features may differ in the last bits)
            assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.parents, expected.parents)
        assert int(tree.tokens[0]) == answers[-1][0].first_token and head._caches[seq_id].length == len(PROMPT)
        trees[seq_id] = answers[-1][0].next_tree, answers[-1][0].first_token
    # the drafter's Prefill sent again at index 1 (the same rows, the same root): its stored answer
    features = codec.encode_tensor(torch.zeros(len(PROMPT), split.drafter.feature_size))
    tree, first_token = trees["g1"]
    again = split.drafter_stub().Prefill(iter([dpb.DrafterPrefillRequest(
        sequence_id="g1", max_rows=128, tokens=[*PROMPT[1:], first_token], features=features)]), timeout=60)
    assert again.tree == tree
    assert head._caches["g1"].length == len(PROMPT)
    # nobody listens at the drafter: every row's features come back, no tree
    gone = [list(stub.Prefill(r, timeout=60)) for r in direct_prefill("g3", f"127.0.0.1:{unused_port()}", 4)]
    assert not gone[-1][0].HasField("next_tree")
    assert codec.decode_tensor(gone[-1][0].features, "features", shape=(None, None)).shape[0] == len(PROMPT)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Prefill(direct_prefill("g4", "nowhere")[0], timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "next_draft.drafter must be host:port" in e.value.details()
    for seq_id in ("g0", "g1", "g2", "g3"):
        stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=60)
        head.release(seq_id)
    assert split.verifier.num_sequences == 0


def test_a_drafter_prefill_sent_again_in_the_same_batch_gets_the_first_ones_answer(split):
    """The verifier's Prefill to the drafter missed its deadline while still queued there, and the
    coordinator's own (the same index) lands in the same batch: one draft KV, both get its tree (a
    second start would refuse the id and fail the sequence). The batch is built directly: which calls
    share a batch over gRPC depends on timing."""
    from drafter_svc.servicer import _Work
    from services.engine.drafter import DraftCall

    servicer = split.drafter
    features = torch.randn(len(PROMPT), servicer.feature_size, generator=torch.Generator().manual_seed(0))
    call = DraftCall("h", torch.tensor(PROMPT), features, TREE)
    first, again = servicer._run_batch([_Work(call, 1, 64, False), _Work(call, 1, 64, False)])
    assert first.HasField("tree") and again == first
    assert servicer.drafter.num_sequences == 1 and servicer.drafter._caches["h"].length == len(PROMPT)
    servicer._release("h")
    # another Prefill under the same id (other rows) is no retry: refused, the first one's KV untouched
    other = DraftCall("h", torch.tensor(PROMPT[:-1]), features[:-1], TREE)
    first, refused = servicer._run_batch([_Work(call, 1, 64, False), _Work(other, 1, 64, False)])
    assert first.HasField("tree") and "already exists" in str(refused)
    assert servicer.drafter._caches["h"].length == len(PROMPT)
    servicer._release("h")


def test_a_release_reaches_a_drafter_the_verifier_was_asked_to_prefill(split):
    """The coordinator asked the verifier for round 1's tree at the drafter and then released the
    sequence without reading an answer (a cancel mid-prefill): the drafter's KV that the verifier's
    Prefill made is released too (RemoteDrafter.prefilling_elsewhere)."""
    from services.rpc.clients import DrafterClient

    list(split.verifier_stub().Prefill(direct_prefill("k", split.addresses["drafter"])[0], timeout=60))
    assert "k" in split.drafter.drafter._caches
    client = DrafterClient(split.addresses["drafter"], split.service.max_message_bytes, 30)
    try:
        remote = client.for_sequence()
        remote.start("k", 128, False)
        remote.prefilling_elsewhere("k")
        remote.release("k")  # (it never saw an answer: no tree, no index)
        wait_until(lambda: "k" not in split.drafter.drafter._caches)
    finally:
        client.close()
    split.verifier_stub().Release(pb.ReleaseRequest(sequence_id="k"), timeout=60)


def direct_prefill(seq_id: str, drafter: str, chunk: int = 0) -> list[vpb.VerifierPrefillRequest]:
    calls = _prefill_drafting(seq_id, chunk)
    for c in calls:
        c.next_draft.drafter = drafter
    return calls


def test_verify_run_with_a_direct_drafter_chains_rounds(split):
    """VerifyRun on a verifier without a head, its next_draft naming the drafter: each round verifies
    the tree the drafter drafted from the round before, and a Verify at a run's round repeats it."""
    stub, tree = _verifier_sequence(split, "e")
    request = vpb.VerifyRunRequest(sequence_id="e", round_index=1, tree=codec.encode_tree(tree), rounds=8,
                                   max_tokens=10)
    request.next_draft.round_index, request.next_draft.drafter = 2, split.addresses["drafter"]
    request.next_draft.tree.CopyFrom(codec.encode_tree_params(TREE))
    answers = list(stub.VerifyRun(request, timeout=60))
    made = [len(a.tokens) for a in answers]
    assert len(answers) > 1 and sum(made[:-1]) < 10 <= sum(made)
    assert [a.round_index for a in answers] == list(range(1, len(answers) + 1))
    assert all(a.HasField("next_tree") for a in answers)
    for a, b in zip(answers, answers[1:]):
        assert b.tokens[0] == a.bonus and codec.decode_tree(a.next_tree, VOCAB).tokens[0] == a.bonus
    again = vpb.VerifyRequest(sequence_id="e", round_index=len(answers), tree=answers[-2].next_tree)
    assert untimed(stub.Verify(again, timeout=60)) == untimed(answers[-1])
    stub.Release(pb.ReleaseRequest(sequence_id="e"), timeout=60)
    split.drafter.drafter.release("e")


def test_a_drafter_the_verifier_cannot_reach_gets_no_more_direct_drafts(model_dirs, redis_url, tmp_path,
                                                                         target_greedy):
    """Drafters that require the internal token, and a verifier that sends a wrong one (as a verifier
    that cannot reach the drafters would fail): its first direct draft fails, the coordinator's own
    Draft to the same drafter works, so the coordinator sends no direct draft to that drafter again
    (for any sequence, until its retry time): one failed direct draft in all, the target's tokens."""
    from services.rpc.security import Security
    from verifier_svc.direct_draft import DirectDrafts

    (tmp_path / "internal").write_text("s3cret\n")
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True,
                       service_overrides={"internal_token_file": str(tmp_path / "internal")})
    try:
        p.verifier._direct = DirectDrafts(p.service, Security(internal_token="wrong"))
        p.coordinator.sequences.unreached.retry_s = 3600.0  # (no retry inside the test, however slow the machine)
        failed_before, drafted_before = direct_counter("failed"), direct_counter("drafted")
        for _ in range(2):
            tokens, messages = generate(p)
            assert tokens == target_greedy[:N] and not any(s.drafted_in_verify for s in rounds(messages))
        assert direct_counter("failed") == failed_before + 1 and direct_counter("drafted") == drafted_before
        assert not p.coordinator.sequences.unreached.reachable(p.addresses["drafter"])
    finally:
        p.close()


def test_unreached_drafters_are_tried_again_after_their_retry_time():
    from coordinator.sequence_placement import UnreachedDrafters

    now = [100.0]
    unreached = UnreachedDrafters(retry_s=60, clock=lambda: now[0])
    assert unreached.reachable("d:1")
    unreached.unreached("d:1")
    assert not unreached.reachable("d:1") and unreached.reachable("d:2")
    now[0] = 159.9
    assert not unreached.reachable("d:1")
    now[0] = 160.0
    assert unreached.reachable("d:1")


@pytest.mark.parametrize("where", ["drafter process", "own head"])
def test_a_run_never_goes_past_a_single_verify_answered_again(split, colocated, where):
    """A VerifyRun whose first round was a single Verify (its answer given again, no round index) ends
    there, with the drafter in another process or the verifier's own head: a run computes a round
    only after one of its own, so the coordinator's engine, which holds a run's trees only for the
    rounds a run answered, never meets a round verified with a tree it did not send
    (services/engine/engine.py, "Tree runs")."""
    p, seq_id = (split, "f") if where == "drafter process" else (colocated, "g")
    stub, tree = _verifier_sequence(p, seq_id)
    single = vpb.VerifyRequest(sequence_id=seq_id, round_index=1, tree=codec.encode_tree(tree))
    single.next_draft.round_index = 2
    single.next_draft.drafter = p.addresses["drafter"] if p is split else ""
    single.next_draft.tree.CopyFrom(codec.encode_tree_params(TREE))
    answer = stub.Verify(single, timeout=60)
    assert answer.HasField("next_tree") and answer.round_index == 0
    run = vpb.VerifyRunRequest(sequence_id=seq_id, round_index=1, tree=single.tree, rounds=8, max_tokens=40,
                               next_draft=single.next_draft)
    assert [untimed(a) for a in stub.VerifyRun(run, timeout=60)] == [untimed(answer)]
    stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=60)
    p.drafter.drafter.release(seq_id)


def test_drafting_ahead_with_direct_drafts_equals_the_split_pipeline(model_dirs, redis_url, split, target_greedy):
    """Overlap on (AERIE_OVERLAP) with direct drafts: a round whose policy drafts ahead sends a DraftAhead
    beside a plain Verify (its next tree: the ahead one on a hit, else the coordinator's Draft); the
    others' next trees come from the verifier's direct Draft (runs with drafting ahead: tests/engine/
    test_draft_in_verify.py). A scripted policy fixes which rounds draft ahead: greedy output is the target's and every round (tree, acceptance, ahead,
    hit) equals the split pipeline's under the same policy; seeded sampling equals it too."""
    from tests.engine.test_draft_in_verify import ScriptedPolicy

    policy = ScriptedPolicy(ahead_at=frozenset({1, 2, 4, 5, 7}))
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True, overlap="on",
                       plain_run=0)  # (no runs: the policy chooses in every round, as the split one does)
    split_policy = split.coordinator.sequences.ahead
    try:
        p.coordinator.sequences.ahead = split.coordinator.sequences.ahead = policy
        drafted_before = direct_counter("drafted")
        tokens, messages = generate(p)
        assert tokens == target_greedy[:N]
        stats = rounds(messages)
        assert sum(s.ahead for s in stats) >= 3 and any(s.ahead_hit for s in stats)
        assert sum(s.drafted_in_verify for s in stats) >= 3
        assert direct_counter("drafted") >= drafted_before + sum(s.drafted_in_verify for s in stats)
        for before, after in zip(stats, stats[1:]):
            assert not (before.ahead and after.drafted_in_verify)  # an ahead round's next tree is not the Verify's
        split_tokens, split_messages = generate(split)
        assert split_tokens == tokens
        assert [(s.tree_size, s.accept_length, s.ahead, s.ahead_hit) for s in rounds(split_messages)] == \
            [(s.tree_size, s.accept_length, s.ahead, s.ahead_hit) for s in stats]
        sampling = SamplingParams(0.9, top_p=0.95, seed=11)
        sampled = [generate(p, 32, sampling)[0] for _ in range(2)]
        assert sampled[0] == sampled[1] == generate(split, 32, sampling)[0]
        wait_until(lambda: p.verifier.num_sequences == 0 and p.drafter.drafter.num_sequences == 0)
    finally:
        split.coordinator.sequences.ahead = split_policy
        p.close()


def test_runs_that_draft_ahead_at_the_verifier_equal_the_split_pipelines_ahead_drafts(model_dirs, redis_url,
                                                                                    target_greedy):
    """Overlap with direct drafts and runs (verifier_svc/ahead_run.py): the coordinator asks for runs of
    tree rounds that draft ahead; the verifier sends each round's DraftAhead beside its verify and, at
    the verdict, takes the ahead tree (a hit) or sends the Draft (a miss). With a policy that drafts
    ahead whenever a guess can hit (`--overlap always`: a guess of one token, every round) every round
    (tree, acceptance, ahead, hit) equals the split pipeline's, where the coordinator sends the
    DraftAhead and the Draft itself; seeded sampling too. Greedy output is the target's."""
    direct = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True, overlap="always")
    split_ahead = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, overlap="always")
    try:
        runs_before, drafted_before = counter("tree_run_rounds"), direct_counter("drafted")
        ahead_before = direct_counter("ahead")
        tokens, messages = generate(direct)
        assert tokens == target_greedy[:N]
        stats = rounds(messages)
        in_runs = counter("tree_run_rounds") - runs_before
        assert in_runs >= 3 and direct_counter("drafted") > drafted_before  # runs, and the verifier's drafts
        assert sum(s.ahead for s in stats) >= len(stats) - 1 and sum(s.ahead_hit for s in stats) >= 2
        # the verifier counts its hits; the coordinator's own ahead drafts (outside runs) hit too
        assert 1 <= direct_counter("ahead") - ahead_before <= sum(s.ahead_hit for s in stats)
        assert any(s.ahead_hit and s.saved_s > 0 for s in stats)
        split_tokens, split_messages = generate(split_ahead)
        assert split_tokens == tokens and not any(s.drafted_in_verify for s in rounds(split_messages))
        key = [(s.tree_size, s.accept_length, s.ahead, s.ahead_hit) for s in stats]
        assert [(s.tree_size, s.accept_length, s.ahead, s.ahead_hit) for s in rounds(split_messages)] == key
        sampling = SamplingParams(0.9, top_p=0.95, seed=11)
        sampled = [generate(direct, 32, sampling)[0] for _ in range(2)]
        assert sampled[0] == sampled[1] == generate(split_ahead, 32, sampling)[0]
        wait_until(lambda: direct.verifier.num_sequences == 0 and direct.drafter.drafter.num_sequences == 0)
    finally:
        direct.close()
        split_ahead.close()


def watch_drafts(head) -> tuple[list[str], list[int]]:
    """Lists the drafter's (services.engine.drafter.Drafter) calls fill from now on: the sequences it
    starts (a Prefill: the first, or a rebuild) and the `first_row` of each draft that carries one."""
    prefills: list[str] = []
    first_rows: list[int] = []
    real_start, real_many = head.start, head.draft_many
    head.start = lambda seq_id, *a, **kw: (prefills.append(seq_id), real_start(seq_id, *a, **kw))[1]

    def many(drafts, *a, **kw):
        first_rows.extend(d.first_row for d in drafts if d.first_row is not None)
        return real_many(drafts, *a, **kw)

    head.draft_many = many
    return prefills, first_rows


@pytest.mark.parametrize("when", ["before", "after", "lost"])
def test_a_failed_draft_ahead_in_a_run_costs_no_rebuild(model_dirs, redis_url, target_greedy, when):
    """One DraftAhead the verifier sends inside a run fails (the drafter itself stays up), before its
    rows reach the draft KV or after (the answer lost): the run ends (ahead_failed, the rows it carried
    back in the answer), the coordinator's next Draft is numbered past it and says where its rows go
    (`first_row`: the drafter drops the rows the failed call added), no rebuild, and the rounds after
    it draft ahead there again. `lost`: the KV also lost a row counted as taken: that Draft answers
    ROWS_MISSING and the coordinator rebuilds the KV on the same drafter. No token is lost or changed."""
    from services.errors import InvalidRequest

    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True, overlap="always")
    head = p.drafter.drafter
    calls, real = [0], head.draft_ahead

    def fails_once(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            if when == "after":
                real(*args, **kwargs)  # its rows are in the KV now
            if when == "lost":
                cache = head._caches[args[0]]
                cache.truncate(cache.length - 1)
            raise InvalidRequest("a DraftAhead that fails (test)")
        return real(*args, **kwargs)

    head.draft_ahead = fails_once
    prefills, first_rows = watch_drafts(head)
    try:
        tokens, messages = generate(p, 2 * N)
        assert tokens == target_greedy
        # the first prefill only (no rebuild), or the rebuild after ROWS_MISSING
        assert calls[0] > 3 and len(prefills) == (2 if when == "lost" else 1)
        assert len(first_rows) == 1  # the coordinator's Draft after the failed call
        state = p.coordinator.store.get(messages[0].sequence_id)
        assert state.drafter == messages[0].info.placement.drafter
        stats = rounds(messages)
        failed = next(i for i, s in enumerate(stats) if s.ahead and not stats[i + 1].ahead_hit
                      and not stats[i + 1].drafted_in_verify)
        assert any(s.ahead_hit for s in stats[failed + 2:])  # drafting ahead (and hitting) again after it
    finally:
        p.close()


def test_runs_that_draft_ahead_with_the_adaptive_budget_leave_for_a_new_shape_without_a_rebuild(
        model_dirs, redis_url, target_greedy, monkeypatch):
    """With the adaptive budget (scripted here: its plans change the shape every few rounds, as measured
    costs do) the coordinator asks for runs that draft ahead too. A plan that changes the shape inside
    such a run leaves it (the run's next tree held as it is: tests/engine/test_draft_in_verify.py) with
    the run's DraftAhead for the next round possibly in flight: the next Draft is numbered past it and
    says where its rows go (`first_row`), never a rebuild. Greedy output is the target's."""
    from services.spec.acceptance import prior_stats
    from services.spec.tree import TreeParams
    from tests.engine.test_draft_in_verify import ScriptedBudget, costs

    small = TreeParams(2, 2, 5)
    script = (TREE,) * 6 + (small,) * 4 + (TREE,) * 7 + (small,) * 3 + (TREE,) * 20
    monkeypatch.setattr(codec, "decode_budget", lambda *a: ScriptedBudget(
        costs(), prior_stats({"top1_agreement": 0.3}), largest=TREE, detach=False, script=script))
    p = start_pipeline(model_dirs, redis_url, draft_dtype=DRAFT_DTYPE, direct_drafts=True, overlap="always")
    head = p.drafter.drafter
    prefills, first_rows = watch_drafts(head)
    try:
        in_runs, ahead_before = counter("tree_run_rounds"), direct_counter("ahead")
        tokens, messages = generate(p, 2 * N)
        assert tokens == target_greedy
        stats = rounds(messages)
        assert counter("tree_run_rounds") - in_runs >= 3 and direct_counter("ahead") > ahead_before  # hits in runs
        assert any(1 < s.tree_size <= small.size for s in stats)  # the small plans applied
        assert len(prefills) == 1 and len(first_rows) >= 2  # runs left for a new shape; no rebuild
        # after each, the next rounds draft ahead inside a run again
        assert sum(s.ahead and s.drafted_in_verify for s in stats) >= len(stats) // 2
    finally:
        p.close()


def test_a_draft_with_first_row_drops_the_rows_a_draft_ahead_added(split):
    """DraftRequest.first_row: a Draft whose rows start before the end of the draft KV (a DraftAhead its
    caller left added some of them) drops the rows from there first, and grows the tree a KV that never
    saw the DraftAhead grows; rows missing before it answer NOT_FOUND naming both counts; a negative
    value is INVALID_ARGUMENT."""
    dstub = split.drafter_stub()
    width = split.drafter.feature_size
    g = torch.Generator().manual_seed(3)
    prompt_features = codec.encode_tensor(torch.randn(len(PROMPT), width, generator=g))
    rows = torch.randn(3, width, generator=g)
    for seq_id in ("fa", "fb"):
        first = dpb.DrafterPrefillRequest(sequence_id=seq_id, max_rows=64, tokens=list(PROMPT), features=prompt_features)
        assert dstub.Prefill(iter([first]), timeout=60).HasField("tree")
    ahead = dpb.DraftAheadRequest(sequence_id="fa", round_index=2, tokens=[7, 9], guess=[11],
                                  features=codec.encode_tensor(rows[:2]))
    dstub.DraftAhead(ahead, timeout=60)
    caches = split.drafter.drafter._caches
    assert caches["fa"].length == len(PROMPT) + 2  # the DraftAhead's rows
    realigned = dstub.Draft(dpb.DraftRequest(sequence_id="fa", round_index=3, tokens=[7, 9, 12], first_row=len(PROMPT),
                                             features=codec.encode_tensor(rows)), timeout=60)
    fresh = dstub.Draft(dpb.DraftRequest(sequence_id="fb", round_index=2, tokens=[7, 9, 12],
                                         features=codec.encode_tensor(rows)), timeout=60)
    assert realigned.tree == fresh.tree and caches["fa"].length == caches["fb"].length
    one = codec.encode_tensor(rows[:1])
    with pytest.raises(grpc.RpcError) as e:
        dstub.Draft(dpb.DraftRequest(sequence_id="fa", round_index=4, tokens=[5], features=one,
                                     first_row=caches["fa"].length + 5), timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    assert "lacks rows before the call's first row" in e.value.details() and "first_row is" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        dstub.Draft(dpb.DraftRequest(sequence_id="fa", round_index=4, tokens=[5], features=one, first_row=-1),
                    timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "first_row must be >= 0; got -1" in e.value.details()
    for seq_id in ("fa", "fb"):
        dstub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=60)


def test_bad_run_ahead_values_are_named_and_a_rebuilt_prefill_refuses_older_calls(split):
    """VerifyRun's `ahead` is checked before the run starts (INVALID_ARGUMENT naming the field), and
    needs a drafter in another process; a drafter Prefill numbered past earlier calls
    (DrafterPrefillRequest.round_index, a rebuild) refuses a call with an older index (a DraftAhead still
    in flight from before the rebuild) and takes the next one."""
    stub, tree = _verifier_sequence(split, "ra")
    base = vpb.VerifyRunRequest(sequence_id="ra", round_index=1, tree=codec.encode_tree(tree), rounds=4,
                                max_tokens=8, next_draft=vpb.NextDraft(round_index=2, drafter=split.addresses["drafter"],
                                                                       tree=codec.encode_tree_params(TREE)))
    for ahead, match in ((vpb.RunAhead(depth=0, max_guess=5), "ahead.depth must be in [1, ahead.max_guess = 5]"),
                         (vpb.RunAhead(depth=6, max_guess=5), "ahead.depth must be in [1, ahead.max_guess = 5]"),
                         (vpb.RunAhead(depth=1, max_guess=0), "ahead.max_guess must be in [1, 66]"),
                         (vpb.RunAhead(depth=1, max_guess=5, branches=9), "ahead.branches must be in [0, 8]")):
        bad = vpb.VerifyRunRequest()
        bad.CopyFrom(base)
        bad.ahead.CopyFrom(ahead)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.VerifyRun(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details(), e.value.details()
    local = vpb.VerifyRunRequest()
    local.CopyFrom(base)
    local.next_draft.drafter = ""
    local.ahead.CopyFrom(vpb.RunAhead(depth=1, max_guess=5))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.VerifyRun(local, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs the drafter in another process" in e.value.details() or "drafts nothing" in e.value.details()
    shapeless = vpb.VerifyRunRequest()
    shapeless.CopyFrom(base)
    shapeless.next_draft.ClearField("tree")
    shapeless.ahead.CopyFrom(vpb.RunAhead(depth=1, max_guess=5))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.VerifyRun(shapeless, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs next_draft.tree" in e.value.details()
    # a Prefill numbered 7 (a rebuild): index 5 is older, 8 is the next
    dstub = split.drafter_stub()
    features = codec.encode_tensor(torch.zeros(len(PROMPT), split.drafter.feature_size))
    first = dpb.DrafterPrefillRequest(sequence_id="rb", max_rows=64, tokens=list(PROMPT), features=features,
                                      round_index=7)
    assert dstub.Prefill(iter([first]), timeout=60).HasField("tree")
    step = codec.encode_tensor(torch.zeros(1, split.drafter.feature_size))
    with pytest.raises(grpc.RpcError) as e:
        dstub.Draft(dpb.DraftRequest(sequence_id="rb", round_index=5, tokens=[3], features=step), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "round 5" in e.value.details()
    assert dstub.Draft(dpb.DraftRequest(sequence_id="rb", round_index=8, tokens=[3], features=step),
                       timeout=60).HasField("tree")
    bad_first = dpb.DrafterPrefillRequest(sequence_id="rb2", max_rows=64, tokens=list(PROMPT), features=features,
                                          round_index=-1)
    with pytest.raises(grpc.RpcError) as e:
        dstub.Prefill(iter([bad_first]), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "round_index must be >= 0" in e.value.details()
    for seq_id in ("ra", "rb"):
        dstub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=60)
        stub.Release(pb.ReleaseRequest(sequence_id=seq_id), timeout=60)
