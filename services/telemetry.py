"""Tracing set-up and the span vocabulary every aerie service uses (OpenTelemetry, optional).

    setup("aerie-verifier")        # OTLP export iff OTEL_EXPORTER_OTLP_ENDPOINT is set
    with start_span("verify", attributes={ROUND: 3}): ...
    inject(metadata) / extract(metadata)  # W3C traceparent in gRPC metadata (interceptors use these)

One trace per request: the coordinator's `generate` span, one `round` span per round under it,
with `draft`, `verify` and `commit` children; the drafter and verifier add a server span under the
coordinator's client span, carried across the process boundary by `traceparent` metadata.

When OpenTelemetry is not installed, or no SDK tracer provider is configured (no endpoint set and
no test installed one), `enabled()` is False and callers skip span work entirely: the cost is one
function call per phase. This module does not define metrics (`services.metrics`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

try:
    from opentelemetry import propagate, trace
    HAVE_OTEL = True
except ImportError:  # pragma: no cover - the package is a dependency; the guard keeps it optional
    HAVE_OTEL = False

log = logging.getLogger("aerie.telemetry")

# Span attribute names (the vocabulary of services/spec/verify.py).
SEQ_ID = "specdec.seq_id"
ROUND_INDEX = "specdec.round_index"  # the round's number (0 = prefill)
ROUND = "specdec.round"  # DEPRECATED (removed next release): ROUND_INDEX, still set
ACCEPT_LENGTH = "specdec.accept_length"
TREE_SIZE = "specdec.tree.size"  # nodes verified, root included
TREE_NODES = "specdec.tree.num_nodes"  # DEPRECATED (removed next release): TREE_SIZE, still set
TREE_MAX_DEPTH = "specdec.tree.max_depth"  # the deepest verified node's depth (root 0)
TREE_DEPTH = "specdec.tree.depth"  # DEPRECATED (removed next release): TREE_MAX_DEPTH, still set
DRAFT_S = "specdec.draft_s"
VERIFY_S = "specdec.verify_s"
COMMIT_S = "specdec.commit_s"
ROUND_S = "specdec.round_s"
AHEAD = "specdec.ahead"  # the next tree was drafted ahead during this round's verify
AHEAD_HIT = "specdec.ahead_hit"  # this round's tree was drafted ahead (the previous guess hit)
SAVED_S = "specdec.saved_s"  # draft seconds this round did not wait for
SERVICE = "aerie.service"
DRAFTER = "aerie.drafter"  # a drafter's address (the verifier's next_draft span)
PROMPT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASON = "gen_ai.response.finish_reasons"

TRACER_NAME = "aerie"


def setup(service_name: str) -> bool:
    """Install an SDK tracer provider exporting over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is
    set (the exporter reads the standard OTEL_* variables itself). Returns whether tracing is on."""
    if not HAVE_OTEL or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or enabled():
        return enabled()
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK/exporter is missing: %s", e)
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans over OTLP to %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return True


def shutdown() -> None:
    """Flush and stop the exporter (called on service exit)."""
    if enabled():
        provider = trace.get_tracer_provider()
        with contextlib.suppress(Exception):
            provider.shutdown()  # type: ignore[attr-defined]


def enabled() -> bool:
    """True when spans are recorded (an SDK tracer provider is installed)."""
    if not HAVE_OTEL:
        return False
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def tracer():
    return trace.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def start_span(name: str, parent: Any = None, kind: str = "internal",
               attributes: dict[str, Any] | None = None) -> Iterator[Any]:
    """A current span (or None when tracing is off). `parent` is a Span or a Context."""
    if not enabled():
        yield None
        return
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    span_kind = getattr(trace.SpanKind, kind.upper())
    with tracer().start_as_current_span(name, context=ctx, kind=span_kind, attributes=attributes) as span:
        yield span


def begin_span(name: str, parent: Any = None, kind: str = "internal", attributes: dict[str, Any] | None = None):
    """A span the caller ends itself (it may end on another thread); None when tracing is off."""
    if not enabled():
        return None
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    return tracer().start_span(name, context=ctx, kind=getattr(trace.SpanKind, kind.upper()),
                               attributes=attributes)


def use_span(span: Any):
    """Make `span` current for a block without ending it (a no-op for None)."""
    if span is None:
        return contextlib.nullcontext()
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def current_context():
    return trace.set_span_in_context(trace.get_current_span()) if enabled() else None


def record_error(span: Any, exc: BaseException) -> None:
    if span is not None:
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))


def inject(metadata: list[tuple[str, str]]) -> None:
    """Append the current trace context (`traceparent`, `tracestate`) to gRPC metadata.
    WARNING: mutates `metadata`."""
    if enabled():
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        metadata.extend(carrier.items())


def extract(metadata) -> Any:
    """The trace context carried by gRPC metadata (a Context), or None."""
    if not enabled() or not metadata:
        return None
    carrier = {k: v for k, v in metadata if isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    return propagate.extract(carrier)
