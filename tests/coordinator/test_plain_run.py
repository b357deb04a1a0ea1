"""Plain runs (DecodeRun) through real gRPC servers and a real Redis: a coordinator that takes its
plain rounds (no drafter, or the drafter detached by the budget) from runs streams the target's own
tokens, the same as one Decode per round (AERIE_PLAIN_RUN=0), greedy and seeded; a stop inside a run
is exact; DecodeRun validates its request; a run broken by its caller is answered again round by
round (no second KV row); a verifier lost mid-run costs a rebuild, never a token."""

import threading

import grpc
import pytest
from prometheus_client import REGISTRY

from services.engine.engine import GenerationRequest
from services.rpc import codec
from services.rpc.stubs import common as pb
from services.rpc.stubs import verifier as vpb
from services.spec.sampling import SamplingParams
from services.spec.tree import root_tree
from tests.coordinator.test_failover import pool, reference, stream  # noqa: F401 (fixtures)
from tests.helpers import InProcessPlainRun, hf_greedy
from verifier_svc.plain_run import RunStep
from tests.pipeline import count_queued_answers, remote_run, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": "coordinator"}) or 0.0


def run_rounds() -> float:
    return counted("aerie_plain_run_rounds_total")


@pytest.fixture(scope="module", params=["read", "queued"])
def plain(model_dirs, redis_url, request):
    """A coordinator without drafters (runs on, the default 16), and one with runs off. (discover=False:
    with discovery on, a coordinator keeps looking for a drafter each round: root-only Verify rounds.)
    `queued`: the verifier queues each greedy run step before the previous token is read (the GPU's
    default; `read`, the CPU's: each token read before the next step is queued)."""
    p = start_pipeline(model_dirs, redis_url, with_drafter=False, discover=False)
    p.verifier.queue_runs = request.param == "queued"
    p.off = p.add_coordinator(redis_url, plain_run=0, discover=False)[1]
    yield p
    p.close()


@pytest.fixture
def queued_answers(monkeypatch):
    """Counts the run steps answered with a QueuedToken (the token read off the model thread)."""
    return count_queued_answers(monkeypatch)


def via(p, address: str, req: GenerationRequest):
    addresses = p.addresses
    p.addresses = {**addresses, "coordinator": address}
    try:
        return remote_run(p, req)
    finally:
        p.addresses = addresses


def test_greedy_plain_runs_equal_the_target_and_runs_off(plain, llama_pair, queued_answers):
    req = GenerationRequest(PROMPT, 40, ignore_eos=True)
    before = run_rounds()
    tokens, reason, accepts = remote_run(plain, req)
    assert tokens == hf_greedy(llama_pair[0], list(PROMPT), 40) and reason == "length"
    assert accepts == [1] * 39  # every plain round its own round (one token each)
    assert run_rounds() - before == 39  # rounds 1..39 came from runs (16 + 16 + 7)
    assert len(queued_answers) == (39 if plain.verifier.queue_runs else 0)  # queued: every step of the runs
    off_before = run_rounds()
    assert via(plain, plain.off, req) == (tokens, reason, accepts)
    assert run_rounds() == off_before
    wait_until(lambda: plain.verifier.num_sequences == 0)


def test_drafters_none_decodes_plainly_even_with_discovery(plain, llama_pair, redis_url):
    """Discovery on and no drafter registered: with an (empty) drafter pool every round verifies a
    root-only tree and looks for a drafter (no runs); `--drafters none` (drafter_pool=False, what
    `aerie up` passes when it starts no drafter) has no pool at all: plain rounds from runs. Both
    give the target's tokens."""
    req = GenerationRequest(PROMPT, 20, ignore_eos=True)
    ref = hf_greedy(llama_pair[0], list(PROMPT), 20)
    pooled = plain.add_coordinator(redis_url, discover=True)[1]
    before = run_rounds()
    assert via(plain, pooled, req)[0] == ref
    assert run_rounds() == before  # root-only Verify rounds
    none = plain.add_coordinator(redis_url, discover=True, drafter_pool=False)[1]
    assert via(plain, none, req)[0] == ref
    assert run_rounds() - before == 19  # rounds 1..19 from runs (16 + 3)
    wait_until(lambda: plain.verifier.num_sequences == 0)

def test_seeded_sampling_is_the_same_with_runs_on_and_off(plain, queued_answers):
    req = GenerationRequest(PROMPT, 30, SamplingParams(0.9, 0.95, 0, 7, logprobs=1), ignore_eos=True)
    on = remote_run(plain, req)
    assert on == via(plain, plain.off, req)
    assert not queued_answers  # sampling (and logprobs): each token read before the next step


@pytest.mark.parametrize("stop", ["stop_id", "max_new_tokens"])
def test_a_stop_inside_a_run_is_exact(plain, llama_pair, stop):
    full = hf_greedy(llama_pair[0], list(PROMPT), 30)
    if stop == "stop_id":
        at = 5  # the stop token's first occurrence is past the run's first round
        stop_id = next(t for i, t in enumerate(full) if i >= at and t not in full[:i])
        end = full.index(stop_id) + 1
        req = GenerationRequest(PROMPT, 30, stop_token_ids=(stop_id,), ignore_eos=True)
        expected = (full[:end], "stop")
    else:
        req = GenerationRequest(PROMPT, 7, ignore_eos=True)
        expected = (full[:7], "length")
    tokens, reason, _ = remote_run(plain, req)
    assert (tokens, reason) == expected
    wait_until(lambda: plain.verifier.num_sequences == 0)  # the run was closed and the KV released


def hold_round(servicer, round_index: int) -> threading.Event:
    """The verifier's model thread stops before the run step of `round_index` until the returned
    event is set: a run stream broken there is broken mid-run whatever the timing."""
    gate = threading.Event()
    run_batch = servicer.batcher._run_batch

    def held(calls):
        if any(isinstance(c, RunStep) and c.round_index == round_index for c in calls):
            gate.wait(60)
        return run_batch(calls)

    servicer.batcher._run_batch = held
    return gate


def prefill(stub, seq_id: str, capacity: int = 64) -> int:
    first = None
    for msg in stub.Prefill(vpb.VerifierPrefillRequest(sequence_id=seq_id, prompt_ids=list(PROMPT),
                                                       sampling=codec.encode_sampling(SamplingParams()),
                                                       capacity=capacity, feature_kind=codec.WIRE_FEATURE_KINDS["none"])):
        first = msg.first_token if first is None else first
    return int(first)


@pytest.mark.parametrize("steps", [0, 65])
def test_decode_run_refuses_steps_out_of_range(plain, steps):
    stub = plain.verifier_stub()
    prefill(stub, f"steps-{steps}")
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.DecodeRun(vpb.DecodeRunRequest(sequence_id=f"steps-{steps}", round_index=1, token=1,
                                                     steps=steps), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == f"steps must be in [1, 64]; got {steps}"
    finally:
        stub.Release(pb.ReleaseRequest(sequence_id=f"steps-{steps}"))


def test_decode_run_of_an_unknown_sequence_is_not_found(plain):
    with pytest.raises(grpc.RpcError) as e:
        list(plain.verifier_stub().DecodeRun(vpb.DecodeRunRequest(sequence_id="nobody", round_index=1, token=1,
                                                                  steps=4), timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in e.value.details()


def test_a_broken_run_is_answered_again_round_by_round(plain, llama_pair):
    """The caller reads two answers and cancels; the verifier had queued the third step already.
    Decode at round 2 (older than the latest round: a plain Decode retry would be refused) and at
    round 3 returns the run's tokens, and the rounds after continue the target's greedy stream (the
    KV holds one row per round)."""
    stub = plain.verifier_stub()
    expected = hf_greedy(llama_pair[0], list(PROMPT), 12)
    tok = prefill(stub, "broken")
    try:
        assert tok == expected[0]
        call = stub.DecodeRun(vpb.DecodeRunRequest(sequence_id="broken", round_index=1, token=tok, steps=8),
                              timeout=60)
        a1, a2 = next(call), next(call)
        call.cancel()
        assert (a1.round_index, a2.round_index) == (1, 2) and [a1.token, a2.token] == expected[1:3]
        again = stub.Decode(vpb.DecodeRequest(sequence_id="broken", round_index=2, token=a1.token), timeout=30)
        assert again.token == a2.token
        tokens = [a1.token, a2.token]
        for r in range(3, 6):  # round 3 at least was computed by the run: answered from it
            tokens.append(stub.Decode(vpb.DecodeRequest(sequence_id="broken", round_index=r, token=tokens[-1]),
                                      timeout=30).token)
        run = stub.DecodeRun(vpb.DecodeRunRequest(sequence_id="broken", round_index=6, token=tokens[-1], steps=6),
                             timeout=60)
        answers = list(run)
        assert [a.round_index for a in answers] == list(range(6, 12))
        tokens += [a.token for a in answers]
        assert tokens == expected[1:12]
        # a run retried from a round it computed answers from the kept rounds (same tokens, no new row)
        retry = list(stub.DecodeRun(vpb.DecodeRunRequest(sequence_id="broken", round_index=9, token=tokens[7],
                                                         steps=3), timeout=60))
        assert [a.token for a in retry] == tokens[8:11]
        with pytest.raises(grpc.RpcError) as e:  # a Verify cannot repeat a run's round
            stub.Verify(vpb.VerifyRequest(sequence_id="broken", round_index=10,
                                          tree=codec.encode_tree(root_tree(tokens[8]))), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "plain step of a run" in e.value.details()
    finally:
        stub.Release(pb.ReleaseRequest(sequence_id="broken"))


def test_a_verifier_lost_mid_run_costs_no_token(model_dirs, redis_url, llama_pair):
    """Two verifiers; the sequence's own stops while a run is open (after the third round streamed):
    the committed tokens stay, the sequence is rebuilt on the other verifier and continues there with
    a run from the next round; the stream is still the target's greedy output."""
    p = start_pipeline(model_dirs, redis_url, with_drafter=False, discover=False)
    gates: dict[str, threading.Event] = {}
    try:
        v2, v2_server, v2_address = p.add_service("verifier", model_dirs)
        replicas = {p.addresses["verifier"]: p.servers[0][0], v2_address: v2_server}
        gates.update({p.addresses["verifier"]: hold_round(p.verifier, 6), v2_address: hold_round(v2, 6)})
        p.coordinator, p.addresses["coordinator"] = p.add_coordinator(
            redis_url, verifiers=(p.addresses["verifier"], v2_address), drafters=(), probe_interval_s=60,
            verifier_wait_s=2, discover=False)
        req = GenerationRequest(PROMPT, 40, ignore_eos=True)
        first = {}

        def kill(i, response):
            if i == 0:
                first["verifier"] = response.info.placement.verifier
                for address, gate in gates.items():
                    if address != first["verifier"]:
                        gate.set()  # the replacement runs freely
            if i == 3:  # rounds 1..16 are one run, held before round 6: this is inside it
                p.stop_server(replicas[first["verifier"]])
                gates[first["verifier"]].set()

        before = run_rounds()
        tokens, messages = stream(p, req, kill)
        assert tokens == hf_greedy(llama_pair[0], list(PROMPT), 40)
        assert messages[-1].finish_reason == "length"
        assert [m.stats.round_index for m in messages] == list(range(len(messages)))
        state = p.coordinator.store.get(messages[0].sequence_id)
        assert state.verifier not in ("", first["verifier"]) and state.tokens == tokens
        assert run_rounds() - before == 39
    finally:
        for gate in gates.values():
            gate.set()
        p.close()


@pytest.fixture(scope="module", params=["read", "queued"])
def detaching(model_dirs, redis_url, request):
    """A coordinator with a drafter and the auto budget (the random tiny head: plain rounds, detached);
    `queued` as for `plain` (the kept features of queued steps)."""
    p = start_pipeline(model_dirs, redis_url, tree=None)
    p.verifier.queue_runs = request.param == "queued"
    p.off = p.add_coordinator(redis_url, plain_run=0)[1]
    yield p
    p.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.8, 0.95, 0, 11)], ids=["greedy", "seeded"])
def test_detached_rounds_from_runs_equal_the_target_and_runs_off(detaching, llama_pair, sampling, queued_answers):
    req = GenerationRequest(PROMPT, 48, sampling, ignore_eos=True)
    detached, runs = counted("aerie_detached_rounds_total"), run_rounds()
    on = remote_run(detaching, req)
    assert counted("aerie_detached_rounds_total") > detached and run_rounds() > runs
    assert bool(queued_answers) == (detaching.verifier.queue_runs and sampling.greedy)
    if sampling.greedy:
        assert on[0] == hf_greedy(llama_pair[0], list(PROMPT), 48)
    off_runs = run_rounds()
    assert via(detaching, detaching.off, req)[:2] == on[:2]
    assert run_rounds() == off_runs


class _RunVerifier:
    """The in-process verifier with `decode_run`; records each run's (first round, steps)."""

    def __init__(self, verifier) -> None:
        self.verifier = verifier
        self.runs: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self.verifier, name)

    def decode_run(self, seq_id, token, round_index, steps, keep_features=False):
        self.runs.append((round_index, steps))
        return InProcessPlainRun(self.verifier, seq_id, token, round_index, steps, keep_features)


def test_the_budget_after_a_run_is_that_after_single_plain_rounds(model_dirs, monkeypatch):
    """The auto budget detaches the tiny random head; with runs, every plan (and the idle_rounds /
    probe_gap it leaves) is the one single rounds see, each run ends the round before the probe's
    attach, and the tokens and round shapes are the same."""
    from services.engine.engine import Engine
    from services.engine.local import build_local_engine

    local = build_local_engine(str(model_dirs.target), str(model_dirs.head), "fp32", None).engine

    def generate(plain_run: int):
        verifier = _RunVerifier(local.verifier)
        engine = Engine(verifier, local.drafter, local.max_context, local.vocab_size, local.eos_token_ids,
                        local.budget, plain_run=plain_run)
        plans = []
        plan = Engine._plan

        def recorded(self, seq_id, seq, chain):
            out = plan(self, seq_id, seq, chain)
            plans.append((out, seq.stats.idle_rounds, seq.stats.probe_gap))
            return out

        with monkeypatch.context() as m:
            m.setattr(Engine, "_plan", recorded)
            steps = list(engine.generate(GenerationRequest(PROMPT, 60, ignore_eos=True)))
        shapes = [(s.tokens, s.stats.detached, s.stats.tree_size) for s in steps]
        return shapes, plans, verifier.runs, [s.stats.run for s in steps]

    shapes, plans, runs, from_run = generate(16)
    single_shapes, single_plans, single_runs, _ = generate(0)
    assert shapes == single_shapes and plans == single_plans and not single_runs
    assert runs and sum(from_run) == sum(n for _, n in runs)
    detached = {s_round for s_round, (_, d, _) in enumerate(shapes) if d}
    for first, n in runs:  # a run covers detached rounds only, and ends before the probe's attach round
        assert set(range(first, first + n)) <= detached
        assert first + n not in detached or n == 16 or first + n > 60


def test_a_verifier_lost_inside_a_detached_run_loses_no_kept_features(pool, reference):
    """A detached run (keep_features) whose verifier goes away after three rounds: the run continues
    on the other verifier from the next round, and the next Verify returns every row since the
    previous one, in order, as root-only Verify rounds would have (tests/coordinator/test_failover.py
    has the same for single Decode calls)."""
    import torch

    from coordinator.sequence_placement import SequencePlacement
    from services.engine.verifier import Verifier

    seqs = pool.coordinator.sequences
    placement = SequencePlacement("detached-run", seqs.verifiers, seqs.drafters, verifier_wait_s=2)
    local = Verifier(reference.verifier.target, "hidden")
    prompt, sampling = torch.tensor(PROMPT), SamplingParams()
    try:
        v = placement.verifier
        tok = v.prefill("detached-run", prompt, sampling, 64).first_token
        ref = local.prefill("ref", prompt, sampling, 64).first_token
        expected = []
        for r in range(1, 8):  # the attached path: root-only Verify rounds, features every round
            out = local.verify("ref", root_tree(ref), r)
            expected.append(out.features)
            ref = out.acceptance.new_tokens[-1]
        first = placement.verifier_client.address
        gate = hold_round(pool.replicas[first][0], 4)
        run = v.decode_run("detached-run", tok, 1, 6, keep_features=True)
        tokens = [next(run) for _ in range(3)]
        pool.stop_server(pool.replicas[first][1])  # takes the kept rows (and the run) with it
        gate.set()
        tokens += [next(run) for _ in range(3)]
        assert run.left == 0 and placement.verifier_client.address != first
        res = v.verify("detached-run", root_tree(tokens[-1]), 7)
        assert res.acceptance.new_tokens[-1] == ref
        torch.testing.assert_close(res.features, torch.cat(expected), rtol=1e-4, atol=1e-4)
    finally:
        placement.close()
