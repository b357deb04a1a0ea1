"""One connected trace per request: the client's span -> the coordinator's generate span -> a round
span per round with draft / verify / commit children -> the drafter's and verifier's server spans,
joined across real gRPC calls by traceparent metadata. (The three services run in this process on
one in-memory exporter; the calls between them are real gRPC.)"""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services import telemetry
from services.engine.engine import GenerationRequest
from services.rpc.coordinator_client import RemoteSession
from tests.pipeline import start_pipeline


@pytest.fixture(scope="module")
def exporter():
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert telemetry.enabled()
    yield exporter
    exporter.shutdown()


@pytest.fixture(scope="module")
def pipeline(exporter, model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    yield p
    p.close()


def traced(exporter, address: str, n: int):
    """One request of `n` tokens (EOS ignored) under a client span: (its steps, the spans of its trace,
    span id -> its children)."""
    exporter.clear()
    session = RemoteSession(address, None, "", timeout_s=60)
    with trace.get_tracer("test").start_as_current_span("client") as client:
        steps = list(session.engine.generate(GenerationRequest((5, 17, 99, 3), n, ignore_eos=True)))
    session.close()
    trace_id = client.get_span_context().trace_id
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    children: dict[int, list] = {}
    for s in spans:
        if s.parent is not None:
            children.setdefault(s.parent.span_id, []).append(s)
    return steps, spans, children


def test_one_connected_trace_across_three_services(pipeline, exporter):
    exporter.clear()
    session = RemoteSession(pipeline.addresses["coordinator"], None, "", timeout_s=60)
    with trace.get_tracer("test").start_as_current_span("client") as client:
        steps = list(session.engine.generate(GenerationRequest((5, 17, 99, 3), 24)))
    session.close()
    rounds = len(steps) - 1
    trace_id = client.get_span_context().trace_id
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in spans}
    # connected: every span but the client's has its parent in this trace
    assert all(s.parent is not None and s.parent.span_id in by_id for s in spans if s.name != "client")

    def parent(s):
        return by_id[s.parent.span_id]

    def named(name):
        return [s for s in spans if s.name == name]

    (generate,) = named("generate")
    assert parent(generate).name == "aerie.v1.Coordinator/Generate" and parent(parent(generate)).name == "client"
    round_spans = {s.attributes[telemetry.ROUND_INDEX]: s for s in named("round")}
    assert all(s.attributes[telemetry.ROUND] == k for k, s in round_spans.items())  # the deprecated name, one release
    assert sorted(round_spans) == list(range(rounds + 1)) and all(parent(s) is generate for s in round_spans.values())
    for index, span in round_spans.items():
        children = sorted(s.name for s in spans if s.parent and s.parent.span_id == span.context.span_id)
        assert children == (["commit", "verify"] if index == 0 else ["commit", "draft", "verify"]), index
        attrs = span.attributes
        assert attrs[telemetry.ACCEPT_LENGTH] == steps[index].stats.accept_length
        if index:
            assert attrs[telemetry.TREE_SIZE] == attrs[telemetry.TREE_NODES] == 16 and 1 <= attrs[telemetry.TREE_MAX_DEPTH] == attrs[telemetry.TREE_DEPTH] <= 4
            assert attrs[telemetry.DRAFT_S] > 0 and attrs[telemetry.VERIFY_S] > 0 and attrs[telemetry.COMMIT_S] > 0
    # the drafter and verifier processes' server spans hang under the coordinator's client spans
    servers = {name: [s for s in spans if s.name == name] for name in (
        "aerie.v1.Verifier/Prefill", "aerie.v1.Verifier/Verify", "aerie.v1.Drafter/Prefill", "aerie.v1.Drafter/Draft")}
    assert len(servers["aerie.v1.Verifier/Prefill"]) == 1 and len(servers["aerie.v1.Drafter/Prefill"]) == 1
    assert len(servers["aerie.v1.Verifier/Verify"]) == rounds
    assert len(servers["aerie.v1.Drafter/Draft"]) == rounds - 1  # round 1's tree came from the Prefill
    for name, found in servers.items():
        role = "verifier" if "Verifier" in name else "drafter"
        for s in found:
            assert s.kind == trace.SpanKind.SERVER and s.attributes[telemetry.SERVICE] == role
            assert parent(s).name == ("verify" if role == "verifier" else "draft") and parent(s).kind == trace.SpanKind.CLIENT


def test_a_failover_is_an_event_on_its_round_span(pipeline, exporter, model_dirs, redis_url):
    """A drafter that goes away mid-stream: the round span open at that moment carries a "failover"
    event (role, from, to, reason) and a "rebuild" event (role, rows, seconds)."""
    _, second, second_address = pipeline.add_service("drafter", model_dirs)
    coordinator, address = pipeline.add_coordinator(redis_url, drafters=(pipeline.addresses["drafter"], second_address),
                                                    discover=False)
    servers = {pipeline.addresses["drafter"]: pipeline.servers[1][0], second_address: second}
    exporter.clear()
    session = RemoteSession(address, None, "", timeout_s=60)
    steps = session.engine.generate(GenerationRequest((5, 17, 99, 3), 40, ignore_eos=True))
    for _ in range(3):
        next(steps)
    (placed,) = [a for a, n in coordinator.sequences.drafters.loads().items() if n == 1]
    pipeline.stop_server(servers[placed])
    rest = list(steps)
    session.close()
    assert rest[-1].finish_reason == "length"
    events = [(e, s) for s in exporter.get_finished_spans() if s.name == "round" for e in s.events]
    (failover,) = [e for e, _ in events if e.name == "failover"]
    assert failover.attributes["aerie.role"] == "drafter" and failover.attributes["aerie.from"] == placed
    assert failover.attributes["aerie.to"] not in ("", placed) and failover.attributes["aerie.reason"] == "unavailable"
    rebuilds = [e for e, _ in events if e.name == "rebuild"]
    assert any(e.attributes["aerie.role"] == "drafter" and e.attributes["aerie.rows"] > 4 for e in rebuilds)


def test_a_realigned_draft_is_an_event_on_its_round_span(pipeline, exporter, model_dirs, redis_url):
    """A DraftAhead that fails inside a run (direct drafts, `--overlap always`): the coordinator's next
    Draft realigns the drafter's KV (DraftRequest.first_row) rather than rebuilding it: a "realign"
    event (role, first_row, rows) on a round span, and no rebuild."""
    from services.errors import InvalidRequest

    servicer, _, drafter = pipeline.add_service("drafter", model_dirs)
    head = servicer.drafter
    calls, real = [0], head.draft_ahead

    def fails_once(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise InvalidRequest("a DraftAhead that fails (test)")
        return real(*args, **kwargs)

    head.draft_ahead = fails_once
    _, address = pipeline.add_coordinator(redis_url, drafters=(drafter,), discover=False, direct_drafts=True,
                                          overlap="always")
    steps, spans, _ = traced(exporter, address, 40)
    assert steps[-1].finish_reason == "length" and calls[0] > 3
    events = [e for s in spans if s.name == "round" for e in s.events]
    (realign,) = [e for e in events if e.name == "realign"]
    assert realign.attributes["aerie.role"] == "drafter" and realign.attributes["aerie.rows"] >= 1
    assert realign.attributes["aerie.first_row"] > 4  # past the prompt's rows
    assert not [e for e in events if e.name == "rebuild"]


def test_drafting_ahead_spans_run_inside_the_previous_round(pipeline, exporter, model_dirs, redis_url):
    """With overlap on (AERIE_OVERLAP), round k+1's tree is drafted ahead during round k: a
    `draft_ahead` CLIENT span (with the drafter's DraftAhead server span below it) under round k+1
    that ends before round k's commit starts; a round whose guess hit has no `draft` span at all.
    Round spans carry ahead / ahead_hit as the stream's stats."""
    from services.spec.overlap import AheadPolicy

    # a drafter of its own: the fail-over test before it may have stopped the pipeline's first one
    _, _, drafter = pipeline.add_service("drafter", model_dirs)
    coordinator, address = pipeline.add_coordinator(redis_url, drafters=(drafter,), discover=False,
                                                    overlap="always")  # draft ahead every round
    assert coordinator.sequences.ahead == AheadPolicy(contention=0.0, learn_cost=False)
    steps, spans, children = traced(exporter, address, 32)
    rounds = {s.attributes[telemetry.ROUND]: s for s in spans if s.name == "round"}
    last = len(steps) - 1
    assert sum(st.stats.ahead_hit for st in steps) > 0
    for k in range(1, last + 1):
        kids = {c.name: c for c in children[rounds[k].context.span_id]}
        stats = steps[k].stats
        assert rounds[k].attributes[telemetry.AHEAD] == stats.ahead is True
        assert rounds[k].attributes[telemetry.AHEAD_HIT] == stats.ahead_hit
        assert ("draft" in kids) == (not stats.ahead_hit)  # a hit waited for no draft
        if k == last:  # (round last + 1 never commits: its span ends when the run exits, maybe after the stream)
            continue
        ahead = {c.name: c for c in children[rounds[k + 1].context.span_id]}["draft_ahead"]
        assert ahead.kind == trace.SpanKind.CLIENT and ahead.end_time <= kids["commit"].start_time
        (server,) = children[ahead.context.span_id]
        assert server.name == "aerie.v1.Drafter/DraftAhead" and server.kind == trace.SpanKind.SERVER


def test_direct_drafts_join_the_trace_below_the_verifiers_call(pipeline, exporter, model_dirs, redis_url):
    """With direct drafts (coordinator --direct-drafts) the verifier sends each verdict's Draft: a
    `next_draft` CLIENT span below its Verify (or VerifyRun) server span, the drafter's Draft server
    span below that, all in the request's trace, and each after the verify it follows; round 1's
    tree alike below its Prefill (the drafter's Prefill)."""
    _, _, drafter = pipeline.add_service("drafter", model_dirs)  # (the fail-over test stopped one)
    _, address = pipeline.add_coordinator(redis_url, drafters=(drafter,), discover=False, direct_drafts=True)
    steps, spans, children = traced(exporter, address, 32)
    by_id = {s.context.span_id: s for s in spans}
    assert all(s.parent is not None and s.parent.span_id in by_id for s in spans if s.name != "client")
    nexts = [s for s in spans if s.name == "next_draft"]
    assert len(nexts) >= 3 and sum(st.stats.drafted_in_verify for st in steps) >= len(nexts) - 1
    assert len({s.attributes[telemetry.ROUND_INDEX] for s in nexts}) == len(nexts)  # one per round
    # round 1's tree: the drafter's Prefill, sent by the verifier from inside its own Prefill
    assert [by_id[s.parent.span_id].name for s in nexts].count("aerie.v1.Verifier/Prefill") == 1
    for s in nexts:
        caller = by_id[s.parent.span_id]
        first = caller.name == "aerie.v1.Verifier/Prefill"
        assert s.kind == trace.SpanKind.CLIENT and s.status.is_ok
        assert caller.name in ("aerie.v1.Verifier/Verify", "aerie.v1.Verifier/VerifyRun", "aerie.v1.Verifier/Prefill")
        assert caller.attributes[telemetry.SERVICE] == "verifier"
        assert s.attributes[telemetry.DRAFTER] == drafter
        assert s.attributes[telemetry.ROUND_INDEX] == 1 if first else s.attributes[telemetry.ROUND_INDEX] >= 2
        (server,) = children[s.context.span_id]
        assert server.name == ("aerie.v1.Drafter/Prefill" if first else "aerie.v1.Drafter/Draft")
        assert server.kind == trace.SpanKind.SERVER
        assert server.attributes[telemetry.SERVICE] == "drafter" and s.start_time <= server.start_time
    # the runs of tree rounds (VerifyRun, --plain-run 16) too: their server spans under a verify_run span
    runs = [s for s in spans if s.name == "aerie.v1.Verifier/VerifyRun"]
    assert runs and all(by_id[s.parent.span_id].name == "verify_run" for s in runs)
    assert any(by_id[s.parent.span_id].name == "aerie.v1.Verifier/VerifyRun" for s in nexts)
    # every Draft the drafter ran for this request hangs under the coordinator's draft or a next_draft
    drafts = [s for s in spans if s.name == "aerie.v1.Drafter/Draft"]
    assert {by_id[s.parent.span_id].name for s in drafts} <= {"draft", "next_draft"}


def test_plain_runs_join_the_trace(pipeline, exporter, redis_url):
    """Plain decoding in runs (DecodeRun, --plain-run 16): each run's server span hangs under a
    `decode_run` CLIENT span of the round it starts from, in the request's trace."""
    _, address = pipeline.add_coordinator(redis_url, drafters=(), discover=False)
    steps, spans, _ = traced(exporter, address, 40)
    assert len(steps) == 40  # one token a round, the prefill's included
    by_id = {s.context.span_id: s for s in spans}
    runs = [s for s in spans if s.name == "aerie.v1.Verifier/DecodeRun"]
    assert len(runs) >= 2  # 40 tokens in runs of at most 16 steps
    for s in runs:
        opened = by_id[s.parent.span_id]
        assert s.kind == trace.SpanKind.SERVER and opened.name == "decode_run" and opened.kind == trace.SpanKind.CLIENT
        assert by_id[opened.parent.span_id].name == "round"
