"""Prometheus metrics of the aerie services (prometheus-client), one endpoint per process.

Every metric carries a `service` label (coordinator | drafter | verifier), so processes that share a
registry (tests running all three in one process) stay distinguishable. Latencies are seconds.

    aerie_round_seconds{service}            one draft -> verify -> commit round (coordinator)
    aerie_accept_length{service}            accept_length: tokens a round committed, accepted drafts + bonus
                                            (m + 1; services/spec/verify.py) (coordinator)
    aerie_draft_seconds{service}            growing a tree (coordinator: the RPC; drafter: the work)
    aerie_verify_seconds{service}           verifying a tree / decoding (coordinator: RPC; verifier: work)
    aerie_prefill_seconds{service}          the prompt forward
    aerie_commit_seconds{service}           the Redis commit of a round (coordinator)
    aerie_tokens_generated_total{service}   committed tokens (coordinator)
    aerie_sequences_in_flight{service}      sequences running (coordinator) or holding KV (drafter, verifier)
    aerie_requests_failed_total{service,code}  calls that ended with an error status
    aerie_redis_up{service}                 1 while the coordinator reaches Redis, else 0 (health follows it)
    aerie_tree_size{service}                tree size (nodes, root included) the budget chose per round, 1 =
                                            a plain step (coordinator); aerie_budget_nodes: its old name,
                                            deprecated, still exported for one release
    aerie_batch_size{service}               calls gathered into one forward (drafter, verifier)
    aerie_batch_rows{service}               rows of one forward (drafter, verifier)
    aerie_batch_queue{service}              calls still waiting when a batch started (drafter, verifier)
    aerie_failovers_total{service,role,reason}  sequences moved (coordinator): role drafter | verifier |
        coordinator; reason unavailable | deadline_exceeded | not_found (the replica lost the sequence)
        | drafter_returned (placed on a drafter after plain rounds) | takeover (counted by the
        coordinator taking a sequence over) | drain (counted by the draining coordinator)

vLLM-style request and speculative-decoding metrics (coordinator; docs/metrics.md has a PromQL
example for each). The names are vLLM's with the `aerie:` prefix instead of `vllm:`, every one
labelled with `model_name`:

    aerie:spec_decode_num_drafts_total                 rounds that verified a draft tree
    aerie:spec_decode_num_draft_tokens_total           draft positions offered (the verified tree's max_depth per round)
    aerie:spec_decode_num_accepted_tokens_total        draft tokens accepted
    aerie:spec_decode_num_accepted_tokens_per_pos_total{position}  accepted at depth position (0 = first)
    aerie:time_to_first_token_seconds                  request arrival -> first committed token
    aerie:inter_token_latency_seconds                  between consecutive streamed rounds with tokens
    aerie:request_time_per_output_token_seconds        (e2e - ttft) / (output tokens - 1), per request
    aerie:e2e_request_latency_seconds                  request arrival -> last message
    aerie:num_requests_running / _waiting              admitted and streaming / arrived, not yet admitted
    aerie:prompt_tokens_total, aerie:generation_tokens_total, aerie:request_success_total{finished_reason}
    aerie:request_queue_time_seconds                   arrival -> admitted (tokenized, placed, created in Redis)
    aerie:request_prefill_time_seconds                 admitted -> first committed token
    aerie:request_decode_time_seconds                  first -> last committed token
    aerie:request_prompt_tokens                        prompt length per request (histogram)
    aerie:request_generation_tokens                    output length per request (histogram)
    aerie:kv_cache_usage_perc                          verifier: KV rows held / its KV budget, 0..1 (vLLM's
                                                       name and unit; not exported without a budget)
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

ROUND_SECONDS = Histogram("aerie_round_seconds", "Latency of one draft/verify/commit round", ["service"],
                          buckets=_LATENCY)
ACCEPT_LENGTH = Histogram("aerie_accept_length", "Tokens produced per round (accepted drafts + bonus)",
                          ["service"], buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))
DRAFT_SECONDS = Histogram("aerie_draft_seconds", "Latency of growing a draft tree", ["service"], buckets=_LATENCY)
VERIFY_SECONDS = Histogram("aerie_verify_seconds", "Latency of verifying a tree (or one decode step)",
                           ["service"], buckets=_LATENCY)
PREFILL_SECONDS = Histogram("aerie_prefill_seconds", "Latency of the prompt forward", ["service"], buckets=_LATENCY)
COMMIT_SECONDS = Histogram("aerie_commit_seconds", "Latency of committing a round to Redis", ["service"],
                           buckets=_LATENCY)
TOKENS_GENERATED = Counter("aerie_tokens_generated", "Committed output tokens", ["service"])
SEQUENCES_IN_FLIGHT = Gauge("aerie_sequences_in_flight", "Sequences running or holding KV", ["service"])
BATCH_SIZE = Histogram("aerie_batch_size", "Calls gathered into one forward (continuous batching)", ["service"],
                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
BATCH_ROWS = Histogram("aerie_batch_rows", "Rows (prompt tokens, tree nodes, decode tokens) of one forward",
                       ["service"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
TREE_SIZE = Histogram("aerie_tree_size", "Tree size (nodes, root included) the draft budget chose to verify per "
                      "round (1 = a plain decode step; with batching: sized for the whole batch)", ["service"],
                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
BUDGET_NODES = Histogram("aerie_budget_nodes", "DEPRECATED (removed next release): aerie_tree_size", ["service"],
                         buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
DETACHED_ROUNDS = Counter("aerie_detached_rounds", "Plain steps with the drafter detached (Decode keeping the "
                          "features on the verifier: no draft call, no features sent)", ["service"])
PLAIN_RUN_ROUNDS = Counter("aerie_plain_run_rounds", "Plain rounds whose token came from a run of plain steps "
                           "(DecodeRun, AERIE_PLAIN_RUN) instead of a Decode call of their own", ["service"])
AHEAD_ROUNDS = Counter("aerie_ahead_rounds", "Rounds that drafted the next tree ahead while their tree was "
                       "verified (AERIE_OVERLAP)", ["service"])
TREE_RUN_ROUNDS = Counter("aerie_tree_run_rounds", "Tree rounds whose verdict came from a run of tree rounds "
                          "(VerifyRun on a verifier that drafts too)", ["service"])
DRAFTS_IN_VERIFY = Counter("aerie_drafts_in_verify", "Rounds whose tree was drafted inside the previous round's "
                           "call to the verifier (a Verify; round 1's: the Prefill), by a verifier that drafts too "
                           "or at the drafter it sent the draft to: no Draft call of their own", ["service"])
DIRECT_DRAFTS = Counter("aerie_direct_drafts", "Next drafts a verifier sent straight to the sequence's drafter "
                        "(coordinator --direct-drafts), by outcome: drafted, ahead (a run's DraftAhead hit: its "
                        "tree, no Draft), or failed (the coordinator drafts)", ["service", "outcome"])
DEVICE_ROUNDS = Counter("aerie_device_rounds", "Tree rounds of a verifier that drafts too whose next tree was "
                        "queued from the verdict on the device (a run's device round), by outcome: kept, or dropped "
                        "(the host read another verdict: drafted after it)", ["service", "outcome"])
AHEAD_HITS = Counter("aerie_ahead_hits", "Rounds that verified a tree drafted ahead (the guess hit: no draft "
                     "waited for)", ["service"])
BUDGET_EXTRA_SECONDS = Gauge("aerie_budget_extra_seconds", "The adaptive budget's measured latency beyond its cost "
                             "model, per verifier (the load board's median of recent rounds), by kind: draft, verify "
                             "(tree rounds), plain", ["service", "verifier", "kind"])
BATCH_QUEUE = Gauge("aerie_batch_queue", "Calls waiting for the next forward when a batch started", ["service"])
FAILOVERS = Counter("aerie_failovers", "Sequences moved to another replica or coordinator",
                    ["service", "role", "reason"])
PREFILL_CHUNK_TIMEOUTS = Counter("aerie_prefill_chunk_timeouts", "Prefill chunks that missed their deadline "
                                 "(each is sent again, up to AERIE_PREFILL_TRIES times)", ["service"])
REDIS_UP = Gauge("aerie_redis_up", "1 while the coordinator reaches Redis (its health is SERVING), else 0",
                 ["service"])
REQUESTS_FAILED = Counter("aerie_requests_failed", "Calls that ended with an error status", ["service", "code"])

# ---- vLLM-style names (the coordinator's requests) -----------------------------------------------
_MODEL = ["model_name"]
_REQUEST_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
SPEC_NUM_DRAFTS = Counter("aerie:spec_decode_num_drafts", "Rounds that verified a draft tree", _MODEL)
SPEC_NUM_DRAFT_TOKENS = Counter("aerie:spec_decode_num_draft_tokens",
                                "Draft positions offered: the verified tree's max depth, per round", _MODEL)
SPEC_NUM_ACCEPTED_TOKENS = Counter("aerie:spec_decode_num_accepted_tokens", "Draft tokens accepted", _MODEL)
SPEC_ACCEPTED_PER_POS = Counter("aerie:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each depth position (0 = first)", _MODEL + ["position"])
TIME_TO_FIRST_TOKEN = Histogram("aerie:time_to_first_token_seconds", "Request arrival to the first committed token",
                                _MODEL, buckets=_TOKEN_LATENCY + (10, 20, 40, 80, 160))
INTER_TOKEN_LATENCY = Histogram("aerie:inter_token_latency_seconds",
                                "Time between consecutive streamed rounds that carry tokens", _MODEL,
                                buckets=_TOKEN_LATENCY)
TIME_PER_OUTPUT_TOKEN = Histogram("aerie:request_time_per_output_token_seconds",
                                  "Per request: (e2e - time to first token) / (output tokens - 1)", _MODEL,
                                  buckets=_TOKEN_LATENCY)
E2E_REQUEST_LATENCY = Histogram("aerie:e2e_request_latency_seconds", "Request arrival to its last message", _MODEL,
                                buckets=_REQUEST_LATENCY)
REQUESTS_RUNNING = Gauge("aerie:num_requests_running", "Requests admitted and streaming", _MODEL)
REQUESTS_WAITING = Gauge("aerie:num_requests_waiting", "Requests arrived and not yet admitted (placement, Redis)",
                         _MODEL)
PROMPT_TOKENS = Counter("aerie:prompt_tokens", "Prompt tokens of admitted requests", _MODEL)
GENERATION_TOKENS = Counter("aerie:generation_tokens", "Output tokens streamed", _MODEL)
REQUEST_SUCCESS = Counter("aerie:request_success", "Requests that finished, by finish reason", _MODEL + ["finished_reason"])
QUEUE_TIME = Histogram("aerie:request_queue_time_seconds", "Request arrival to its admission (tokenized, placed, "
                       "created in Redis)", _MODEL, buckets=_REQUEST_LATENCY)
PREFILL_TIME = Histogram("aerie:request_prefill_time_seconds", "Admission to the first committed token", _MODEL,
                         buckets=_REQUEST_LATENCY)
DECODE_TIME = Histogram("aerie:request_decode_time_seconds", "The first to the last committed token", _MODEL,
                        buckets=_REQUEST_LATENCY)
_LENGTHS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
PROMPT_LENGTH = Histogram("aerie:request_prompt_tokens", "Prompt tokens per admitted request", _MODEL,
                          buckets=_LENGTHS)
GENERATION_LENGTH = Histogram("aerie:request_generation_tokens", "Output tokens per finished request", _MODEL,
                              buckets=_LENGTHS)
KV_CACHE_USAGE = Gauge("aerie:kv_cache_usage_perc", "Verifier KV rows held over its KV budget (0..1)", _MODEL)
NUM_PREEMPTIONS = Counter("aerie:num_preemptions", "Sequences whose verifier KV was released so that older ones "
                          "could grow (prefilled again by their coordinator)", _MODEL)


def model_label(target: str) -> str:
    """A target path as the `model_name` label of a process that does not know the served name (the
    verifier): '/m/SmolLM2.Q8_0.gguf' -> 'SmolLM2.Q8_0', '/m/Llama/' -> 'Llama' (coordinator/text.py
    `served_name`'s rule, which is the coordinator's label unless --served-model-name is set)."""
    from pathlib import Path

    p = Path(target.rstrip("/"))
    return p.stem if p.suffix.lower() == ".gguf" else p.name or target


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics: the Prometheus text format; any other path: 404 (prometheus_client's own server
    answers every path with the metrics, so `curl :port/health` looked like a health check)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] == "/metrics":
            status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY)
        else:
            status, ctype, body = 404, "text/plain; charset=utf-8", b"not found: metrics are served on /metrics\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # scrapes are not log lines
        pass


def serve_metrics(port: int | None, host: str = "0.0.0.0") -> int | None:
    """Start the /metrics HTTP endpoint on a daemon thread; port 0 picks a free one. Returns the port
    (None = off)."""
    if port is None:
        return None
    server = ThreadingHTTPServer((host, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return int(server.server_port)
