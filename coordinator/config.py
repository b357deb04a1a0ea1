"""Coordinator configuration: flags and AERIE_* variables -> CoordinatorConfig.

    AERIE_COORDINATOR_PORT (50051), AERIE_REDIS_URL, AERIE_DRAFTERS, AERIE_VERIFIERS,
    AERIE_MAX_NEW_TOKENS (4096), AERIE_SEQUENCE_TTL_S (86400), AERIE_MAX_SEQUENCES (256),
    AERIE_RPC_TIMEOUT_S (60), AERIE_RESOLVE_INTERVAL_S (10), AERIE_TOKENIZER (the verifier's target),
    AERIE_SERVED_MODEL_NAME, AERIE_HTTP_PORT (off), AERIE_VERIFIER_WAIT_S (30),
    AERIE_PROBE_INTERVAL_S (2), AERIE_DISCOVER (1), AERIE_DISCOVER_INTERVAL_S (1),
    AERIE_FINISHED_TTL_S (3600), AERIE_REDIS_RETRY_S (30), AERIE_REDIS_PING_TIMEOUT_S (1), AERIE_LEASE_TTL_S (10),
    AERIE_MAX_SEQUENCES_PER_CLIENT (64), AERIE_MAX_QUEUED_REQUESTS (1024), AERIE_QUEUE_TIMEOUT_S (600),
    AERIE_PREFILL_TRIES (3), AERIE_OVERLAP (0), AERIE_PLAIN_RUN (16), AERIE_TRUSTED_PROXIES (loopback),
    AERIE_RATE_LIMIT_RPS (0 = off), AERIE_RATE_LIMIT_BURST (20), the HTTP gateway's AERIE_HTTP_*
    (gateway/limits.py), and the common ones in
    services/rpc/config.py.

AERIE_DRAFTERS / AERIE_VERIFIERS are comma-separated host:port entries; a host name may resolve to
several addresses (a Kubernetes headless service), re-resolved every AERIE_RESOLVE_INTERVAL_S.
An empty drafter list means plain decoding (no speculation).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gateway import limits as http_limits
from gateway.limits import HttpLimits
from services.rpc.security import redact
from coordinator.rate_limit import RateLimits
from services.rpc.forwarded import DEFAULT_TRUSTED_PROXIES, TrustedProxies
from services.rpc.config import ConfigError, ServiceConfig, add_service_flags, endpoint_problem, env, service_config

DEFAULT_PORT = 50051


def parse_endpoints(text: str, name: str) -> tuple[str, ...]:
    """'a:1, b:2' -> ('a:1', 'b:2'); '[::1]:50052' is an IPv6 literal."""
    entries = tuple(e.strip() for e in (text or "").split(",") if e.strip())
    for e in entries:
        if endpoint_problem(e):
            raise ConfigError(f"{name} entries must be host:port; got {e!r}")
    return entries


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    service: ServiceConfig
    verifiers: tuple[str, ...]  # host:port entries
    drafters: tuple[str, ...] = ()  # host:port entries; empty: only drafters that register in Redis (discover)
    drafter_pool: bool = True  # False (--drafters none): plain decoding, no drafter even a discovered one
    redis_url: str = "redis://127.0.0.1:6379/0"
    max_new_tokens: int = 4096  # the most a request may ask for
    sequence_ttl_s: int = 86400  # a sequence's Redis record expires this long after its last update
    max_sequences: int = 256  # sequences running on this coordinator at once
    max_queued_requests: int = 1024  # requests waiting for one of those slots (FIFO); 0 = refuse at once
    queue_timeout_s: float = 600.0  # the longest a request waits for a slot, then RESOURCE_EXHAUSTED
    rpc_timeout_s: float = 60.0  # deadline of each call to a drafter or verifier (each prefill chunk's too)
    prefill_tries: int = 3  # calls per prefill chunk that misses its deadline, then DEADLINE_EXCEEDED
    resolve_interval_s: float = 10.0  # re-resolve the pools' host names
    retrieval: bool = False  # SAM retrieval chains (services/spec/sam.py), held here per sequence
    # draft the next tree ahead while one is verified (DraftAhead during Verify): "off"; "on" (the
    # per-sequence policy decides, services/spec/overlap.py); "always" (whenever a guess can hit: measurements)
    overlap: str = "off"
    # plain rounds per DecodeRun call (services/engine/engine.py "Plain runs"); 0 = one Decode per plain round
    plain_run: int = 16
    # a Verify's next tree drafted at the sequence's drafter by the verifier itself (NextDraft.drafter,
    # verifier_svc/direct_draft.py): one call an EAGLE round, and runs of tree rounds
    direct_drafts: bool = False
    tokenizer: str | None = None  # text: a directory or .gguf; None = the verifier's target; "none" = ids only
    served_model_name: str | None = None  # the model's name in the APIs; None = the target's file name
    model_aliases: tuple[str, ...] = ()  # more names requests may use (--served-model-name A B: B here)
    http_port: int | None = None  # the OpenAI-compatible HTTP API (gateway/); None = off, 0 = any free port
    verifier_wait_s: float = 30.0  # with no verifier answering, a sequence waits this long, then UNAVAILABLE
    probe_interval_s: float = 2.0  # a replica that failed a call is probed again (GetInfo) after this
    finished_ttl_s: int = 3600  # the record of a finished / cancelled / failed sequence expires after this
    redis_retry_s: float = 30.0  # an unreachable Redis is retried with backoff this long, then UNAVAILABLE
    redis_ping_timeout_s: float = 1.0  # health's PING: a Redis that does not answer within it is down
    lease_ttl_s: float = 10.0  # a running sequence whose coordinator stops renewing is taken over after this
    discover: bool = True  # also place on replicas registered in Redis (services/rpc/registry.py)
    discover_interval_s: float = 1.0  # re-read the registry this often
    # Generate streams one client may have open at once: by API identity, else by peer host; 0 = no limit
    max_sequences_per_client: int = 64
    # peers whose `aerie-forwarded-for` names the client (the HTTP gateway's; services/rpc/forwarded.py)
    trusted_proxies: str = DEFAULT_TRUSTED_PROXIES
    rate_limit_rps: float = 0.0  # Generate calls per second one client may start (a token bucket); 0 = off
    rate_limit_burst: int = 20  # ... and at once after an idle while (coordinator/rate_limit.py)
    http_limits: HttpLimits = HttpLimits()  # what one HTTP client may make the gateway hold (gateway/limits.py)

    def __post_init__(self) -> None:
        if not self.verifiers and not self.discover:
            raise ConfigError("the coordinator needs verifiers: set --verifiers / AERIE_VERIFIERS, or discover "
                              "registered ones (AERIE_DISCOVER=1)")
        parse_endpoints(",".join(self.verifiers), "verifiers")
        parse_endpoints(",".join(self.drafters), "drafters")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis_url must start with redis://, rediss:// or unix://; got {redact(self.redis_url)!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ConfigError(f"overlap must be one of {', '.join(OVERLAP_MODES)}; got {self.overlap!r}")
        if not 0 <= self.plain_run <= MAX_PLAIN_RUN:
            raise ConfigError(f"plain_run must be in [0, {MAX_PLAIN_RUN}] (0 = off); got {self.plain_run}")
        if self.redis_retry_s < 0:
            raise ConfigError(f"redis_retry_s must be >= 0; got {self.redis_retry_s}")
        for name in ("max_new_tokens", "sequence_ttl_s", "max_sequences", "finished_ttl_s", "prefill_tries"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.model_aliases and not self.served_model_name:
            raise ConfigError("model_aliases need a served_model_name (the first --served-model-name)")
        names = [n for n in (self.served_model_name, *self.model_aliases) if n is not None]
        if any(not n.strip() for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"--served-model-name needs distinct non-empty names; got {names}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ConfigError(f"http_port must be in [0, 65535]; got {self.http_port}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be >= 0 (0 = refuse at once); got {self.max_queued_requests}")
        if not self.queue_timeout_s >= 0:
            raise ConfigError(f"queue_timeout_s must be >= 0; got {self.queue_timeout_s}")
        if self.max_sequences_per_client < 0:
            raise ConfigError(f"max_sequences_per_client must be >= 0 (0 = no limit); got {self.max_sequences_per_client}")
        TrustedProxies.parse(self.trusted_proxies)  # ConfigError naming a bad entry
        RateLimits(self.rate_limit_rps, self.rate_limit_burst)  # ConfigError naming a bad value
        if self.verifier_wait_s < 0:
            raise ConfigError(f"verifier_wait_s must be >= 0; got {self.verifier_wait_s}")
        for name in ("rpc_timeout_s", "resolve_interval_s", "probe_interval_s", "discover_interval_s", "lease_ttl_s",
                     "redis_ping_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0; got {getattr(self, name)}")


def add_flags(p: argparse.ArgumentParser, with_service: bool = True) -> None:
    if with_service:
        add_service_flags(p, "AERIE_COORDINATOR_PORT", DEFAULT_PORT)
    g = p.add_argument_group("coordinator")
    g.add_argument("--verifiers", default=env("AERIE_VERIFIERS", ""), help="host:port list; may be empty when verifiers register in Redis (AERIE_VERIFIERS)")
    g.add_argument("--drafters", default=env("AERIE_DRAFTERS", ""),
                   help="host:port list; 'none' = plain decoding, never a drafter (not even one registered in "
                        "Redis); empty = only drafters registered in Redis (--discover), plain rounds until one "
                        "registers (AERIE_DRAFTERS)")
    g.add_argument("--retrieval", action="store_true", default=env("AERIE_RETRIEVAL"),
                   help="join retrieved chains (suffix index over prompt + output) to the drafts; "
                        "with no drafters: retrieval drafts only (AERIE_RETRIEVAL=1; default: off)")
    g.add_argument("--direct-drafts", type=on_off, default=env("AERIE_DIRECT_DRAFTS", "0"),
                   help="verifiers send each verdict's Draft straight to the sequence's drafter and answer with "
                        "the next tree: one Verify call an EAGLE round, and runs of tree rounds "
                        "(VerifyRun); verifiers must reach the drafters (AERIE_DIRECT_DRAFTS, 0; docs/distributed.md)")
    g.add_argument("--overlap", type=overlap_mode, default=env("AERIE_OVERLAP", "0"),
                   help="draft the next tree ahead while one is verified: a DraftAhead call from a guessed verdict "
                        "overlaps each Verify; 1: the per-sequence policy turns it off where it cannot pay; always: "
                        "whenever a guess can hit (measurements) (AERIE_OVERLAP, 0; docs/distributed.md)")
    g.add_argument("--plain-run", type=int, default=env("AERIE_PLAIN_RUN", 16), metavar="N",
                   help="plain decode rounds per DecodeRun call: the verifier runs up to N plain steps back to back "
                        "while the coordinator commits them; with a fixed tree on a verifier that drafts too, tree "
                        "rounds per VerifyRun call likewise; 0 = one call a round (AERIE_PLAIN_RUN, 16; "
                        "docs/distributed.md)")
    g.add_argument("--redis-url", default=env("AERIE_REDIS_URL", "redis://127.0.0.1:6379/0"), help="the Redis holding sequence state (AERIE_REDIS_URL)")
    g.add_argument("--max-new-tokens-limit", type=int, default=env("AERIE_MAX_NEW_TOKENS", 4096),
                   help="the most new tokens a request may ask for (AERIE_MAX_NEW_TOKENS)")
    g.add_argument("--sequence-ttl-s", type=int, default=env("AERIE_SEQUENCE_TTL_S", 86400),
                   help="lifetime of a sequence's Redis record after its last update (AERIE_SEQUENCE_TTL_S)")
    g.add_argument("--max-sequences", type=int, default=env("AERIE_MAX_SEQUENCES", 256),
                   help="sequences running at once on this coordinator (AERIE_MAX_SEQUENCES)")
    g.add_argument("--max-queued-requests", type=int, default=env("AERIE_MAX_QUEUED_REQUESTS", 1024),
                   help="requests that wait for one of the --max-sequences slots (in turns across clients); one more is "
                        "refused at once (HTTP 503 with Retry-After); 0 = refuse at once when every slot is taken "
                        "(AERIE_MAX_QUEUED_REQUESTS)")
    g.add_argument("--queue-timeout-s", type=float, default=env("AERIE_QUEUE_TIMEOUT_S", 600.0),
                   help="the longest a request waits for a slot, then HTTP 503 with Retry-After "
                        "(AERIE_QUEUE_TIMEOUT_S)")
    g.add_argument("--max-sequences-per-client", type=int, default=env("AERIE_MAX_SEQUENCES_PER_CLIENT", 64),
                   help="Generate streams one client may have open at once, by API identity, else by peer host; "
                        "0 = no limit (AERIE_MAX_SEQUENCES_PER_CLIENT; default: 64)")
    g.add_argument("--trusted-proxies", default=env("AERIE_TRUSTED_PROXIES", DEFAULT_TRUSTED_PROXIES),
                   help="addresses or networks (comma-separated; '*' = any, '' = none) whose 'aerie-forwarded-for' "
                        "metadata names the client the per-client limits count: the HTTP gateway's callers "
                        "without API tokens (AERIE_TRUSTED_PROXIES; default: loopback)")
    g.add_argument("--rate-limit-rps", type=float, default=env("AERIE_RATE_LIMIT_RPS", 0.0),
                   help="Generate calls per second one client (API identity, else peer host) may start; over it "
                        "RESOURCE_EXHAUSTED / HTTP 429 with Retry-After; 0 = off (AERIE_RATE_LIMIT_RPS)")
    g.add_argument("--rate-limit-burst", type=int, default=env("AERIE_RATE_LIMIT_BURST", 20),
                   help="calls one client may start at once after an idle while (AERIE_RATE_LIMIT_BURST)")
    g.add_argument("--rpc-timeout-s", type=float, default=env("AERIE_RPC_TIMEOUT_S", 60.0),
                   help="deadline of each drafter/verifier call, each prefill chunk its own (AERIE_RPC_TIMEOUT_S)")
    g.add_argument("--prefill-tries", type=int, default=env("AERIE_PREFILL_TRIES", 3),
                   help="calls per prefill chunk that misses its deadline (sent again to the same verifier), "
                        "then the sequence fails with DEADLINE_EXCEEDED (AERIE_PREFILL_TRIES, 3)")
    g.add_argument("--resolve-interval-s", type=float, default=env("AERIE_RESOLVE_INTERVAL_S", 10.0),
                   help="re-resolve pool host names this often (AERIE_RESOLVE_INTERVAL_S)")
    g.add_argument("--tokenizer", default=env("AERIE_TOKENIZER"),
                   help="the target's tokenizer for text requests (a directory or .gguf; only the tokenizer is "
                        "read); default: the target the verifier serves; 'none' = token ids only (AERIE_TOKENIZER)")
    g.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                   help="the model's names in the APIs: the first is the one answers carry, a request may use any "
                        "(AERIE_SERVED_MODEL_NAME, comma-separated; default: the target's file name)")
    g.add_argument("--http-port", type=int, default=env("AERIE_HTTP_PORT"),
                   help="serve the OpenAI-compatible HTTP API on this port, 0 = any free port; default: off "
                        "(AERIE_HTTP_PORT)")

    g.add_argument("--verifier-wait-s", type=float, default=env("AERIE_VERIFIER_WAIT_S", 30.0),
                   help="with no verifier answering, a sequence waits this long before UNAVAILABLE "
                        "(AERIE_VERIFIER_WAIT_S, 30)")
    g.add_argument("--probe-interval-s", type=float, default=env("AERIE_PROBE_INTERVAL_S", 2.0),
                   help="a replica that failed a call is probed again after this (AERIE_PROBE_INTERVAL_S, 2)")

    g.add_argument("--finished-ttl-s", type=int, default=env("AERIE_FINISHED_TTL_S", 3600),
                   help="lifetime of a finished sequence's Redis record (AERIE_FINISHED_TTL_S, 3600)")
    g.add_argument("--redis-retry-s", type=float, default=env("AERIE_REDIS_RETRY_S", 30.0),
                   help="retry an unreachable Redis with backoff this long (AERIE_REDIS_RETRY_S, 30)")
    g.add_argument("--redis-ping-timeout-s", type=float, default=env("AERIE_REDIS_PING_TIMEOUT_S", 1.0),
                   help="health's PING of Redis: one not answered within this is a Redis down (stalled or dead): "
                        "health NOT_SERVING (AERIE_REDIS_PING_TIMEOUT_S, 1)")
    g.add_argument("--lease-ttl-s", type=float, default=env("AERIE_LEASE_TTL_S", 10.0),
                   help="another coordinator takes over a sequence whose lease is this old (AERIE_LEASE_TTL_S, 10)")
    g.add_argument("--discover", type=on_off, default=env("AERIE_DISCOVER", "1"),
                   help="also use drafters and verifiers registered in Redis (AERIE_DISCOVER, 1; 0 = only the "
                        "static lists)")
    g.add_argument("--discover-interval-s", type=float, default=env("AERIE_DISCOVER_INTERVAL_S", 1.0),
                   help="re-read the registry this often (AERIE_DISCOVER_INTERVAL_S, 1)")
    http_limits.add_flags(p)


OVERLAP_MODES = ("off", "on", "always")
MAX_PLAIN_RUN = 64  # DecodeRunRequest.steps' limit (verifier_svc/plain_run.py)


def overlap_mode(text: str | bool) -> str:
    """--overlap / AERIE_OVERLAP: 1/0 (and the other on/off spellings) or "always"."""
    if str(text).lower() in OVERLAP_MODES:
        return str(text).lower()
    return "on" if on_off(text) else "off"


def on_off(text: str | bool) -> bool:
    """A switch's value: 1/0, true/false, on/off, yes/no (argparse.ArgumentTypeError otherwise)."""
    if isinstance(text, bool):
        return text
    if text.lower() in ("1", "true", "on", "yes"):
        return True
    if text.lower() in ("0", "false", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1 or 0; got {text!r}")


def served_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name's names, else AERIE_SERVED_MODEL_NAME's (comma-separated), else []."""
    if args.served_model_name:
        return list(args.served_model_name)
    return [n.strip() for n in str(env("AERIE_SERVED_MODEL_NAME", "")).split(",") if n.strip()]


def _no_drafters(text: str) -> bool:
    """--drafters none: no drafter pool at all."""
    return text.strip().lower() == "none"


def from_args(args: argparse.Namespace) -> CoordinatorConfig:
    names = served_names(args)
    return CoordinatorConfig(
        service_config(args), verifiers=parse_endpoints(args.verifiers, "verifiers"),
        drafters=() if _no_drafters(args.drafters) else parse_endpoints(args.drafters, "drafters"),
        drafter_pool=not _no_drafters(args.drafters), redis_url=args.redis_url,
        max_new_tokens=args.max_new_tokens_limit, sequence_ttl_s=args.sequence_ttl_s,
        max_sequences=args.max_sequences, max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout_s, rpc_timeout_s=args.rpc_timeout_s, prefill_tries=args.prefill_tries,
        resolve_interval_s=args.resolve_interval_s, tokenizer=args.tokenizer,
        served_model_name=names[0] if names else None, model_aliases=tuple(names[1:]), http_port=args.http_port,
        retrieval=args.retrieval is True or str(args.retrieval or "") not in ("", "0", "False"),  # flag or env
        overlap=overlap_mode(args.overlap), plain_run=args.plain_run, direct_drafts=on_off(args.direct_drafts),
        verifier_wait_s=args.verifier_wait_s,
        probe_interval_s=args.probe_interval_s, finished_ttl_s=args.finished_ttl_s,
        redis_retry_s=args.redis_retry_s, redis_ping_timeout_s=args.redis_ping_timeout_s, lease_ttl_s=args.lease_ttl_s, discover=on_off(args.discover),
        discover_interval_s=args.discover_interval_s, max_sequences_per_client=args.max_sequences_per_client,
        trusted_proxies=args.trusted_proxies, rate_limit_rps=args.rate_limit_rps,
        rate_limit_burst=args.rate_limit_burst, http_limits=http_limits.from_args(args))
