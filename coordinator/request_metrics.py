"""The vLLM-style metrics of one Generate call (services/metrics.py names them; docs/metrics.md).

    m = RequestMetrics(model)        # arrival: waiting
    m.admitted(prompt_tokens)        # running; queue time, prompt length
    m.round(stats, n_tokens)         # each streamed round: drafts, acceptance, TTFT, ITL
    m.finished(reason)               # e2e, time per output token, prefill and decode time, output length, success
    m.close()                        # always: leaves the running / waiting gauges
"""

from __future__ import annotations

import time

from services import metrics
from services.engine.engine import RoundStats


class RequestMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.admitted_at: float | None = None
        self._gauge = metrics.REQUESTS_WAITING.labels(model)
        self._gauge.inc()

    def _move(self, gauge) -> None:
        if self._gauge is not None:
            self._gauge.dec()
        self._gauge = gauge
        if gauge is not None:
            gauge.inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.admitted_at = time.perf_counter()
        self._move(metrics.REQUESTS_RUNNING.labels(self.model))
        metrics.PROMPT_TOKENS.labels(self.model).inc(prompt_tokens)
        metrics.QUEUE_TIME.labels(self.model).observe(self.admitted_at - self.t0)
        metrics.PROMPT_LENGTH.labels(self.model).observe(prompt_tokens)

    def round(self, stats: RoundStats, n_tokens: int) -> None:
        m = self.model
        # a speculative round: one that verified at least one draft token (a plain step, or a
        # root-only tree on a pipeline without drafters, reports tree_max_depth 0: not a draft)
        if stats.round_index > 0 and stats.tree_max_depth > 0:
            accepted = stats.accepted
            metrics.SPEC_NUM_DRAFTS.labels(m).inc()
            metrics.SPEC_NUM_DRAFT_TOKENS.labels(m).inc(stats.tree_max_depth)
            metrics.SPEC_NUM_ACCEPTED_TOKENS.labels(m).inc(accepted)
            for pos in range(accepted):
                metrics.SPEC_ACCEPTED_PER_POS.labels(m, str(pos)).inc()
        if n_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            metrics.TIME_TO_FIRST_TOKEN.labels(m).observe(now - self.t0)
        else:
            metrics.INTER_TOKEN_LATENCY.labels(m).observe(now - self.last)
        self.last = now
        self.tokens += n_tokens
        metrics.GENERATION_TOKENS.labels(m).inc(n_tokens)

    def finished(self, reason: str) -> None:
        now = time.perf_counter()
        metrics.E2E_REQUEST_LATENCY.labels(self.model).observe(now - self.t0)
        if self.first is not None and self.tokens > 1:
            metrics.TIME_PER_OUTPUT_TOKEN.labels(self.model).observe((now - self.first) / (self.tokens - 1))
        if self.first is not None:
            if self.admitted_at is not None:
                metrics.PREFILL_TIME.labels(self.model).observe(self.first - self.admitted_at)
            metrics.DECODE_TIME.labels(self.model).observe(self.last - self.first)
        metrics.GENERATION_LENGTH.labels(self.model).observe(self.tokens)
        metrics.REQUEST_SUCCESS.labels(self.model, reason).inc()

    def close(self) -> None:
        self._move(None)
