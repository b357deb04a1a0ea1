"""Durable sequence state in Redis: the only module that talks to Redis.

Layout (the `{id}` braces are a Redis Cluster hash tag: a sequence's keys share a slot):

    aerie:seq:{id}            hash   prompt_ids (comma-separated), params (JSON), seed, round, status,
                                     finish_reason, error, cancel, drafter, verifier, created
    aerie:seq:{id}:tokens     list   every committed token, in order
    aerie:seq:{id}:logprobs   list   only for a sequence that asked for log-probabilities: one entry per
                                     committed token, aligned with :tokens (coordinator/stored_logprobs.py),
                                     so that Resume streams them too

`round` is the last committed round's index (-1 before the prefill commits; read back as
`SequenceState.round_index`: a stored field keeps its name, since coordinators of two releases share
the records during a rolling upgrade). `commit` is one Lua script, so
a round's tokens, its index and a finish land atomically; it is keyed by round index, so a retried
commit of a round already there changes nothing. It also reports a pending cancel request, so a
cancel issued through any coordinator reaches the one driving the sequence without an extra round
trip. The keys expire `ttl_s` after the last update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import grpc
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.errors import InvalidRequest, SequenceNotFound
from services.rpc.errors import DownstreamError, SequenceExists

Status = Literal["running", "finished", "cancelled", "failed"]
PREFIX = "aerie:seq:"
LEASES = "aerie:leases"  # sorted set: running sequence id -> lease expiry (ms); a hint for take-overs
log = logging.getLogger("aerie.coordinator")


class LeaseLost(Exception):
    """Another coordinator took this sequence over (its lease had expired): stop driving it."""

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""

# KEYS: hash, tokens, logprobs. ARGV: round, finish_reason ('' = still running), ttl_s, owner ('' = no
# lease), lease_ms, n (tokens), n tokens..., then n log-probability entries or none. Returns {applied (0|1), cancel requested (0|1)}. With an owner, the commit is
# fenced: it fails with LEASE when another coordinator holds an unexpired lease, and renews the
# caller's lease otherwise.
_COMMIT = """
local cur = redis.call('HGET', KEYS[1], 'round')
if not cur then return redis.error_reply('NOTFOUND') end
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if ARGV[4] ~= '' then
  local owner = redis.call('HGET', KEYS[1], 'owner')
  local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
  if owner and owner ~= '' and owner ~= ARGV[4] and lease > now then
    return redis.error_reply('LEASE held by coordinator ' .. owner)
  end
end
local cancel = 0
if redis.call('HGET', KEYS[1], 'cancel') == '1' then cancel = 1 end
local r = tonumber(ARGV[1])
cur = tonumber(cur)
if r <= cur then return {0, cancel} end
if r ~= cur + 1 then return redis.error_reply('GAP round ' .. r .. ' after round ' .. cur) end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return redis.error_reply('ENDED sequence is ' .. status) end
local n = tonumber(ARGV[6])
if n > 0 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 7, 6 + n)) end
if #ARGV > 6 + n then redis.call('RPUSH', KEYS[3], unpack(ARGV, 7 + n)) end
redis.call('HSET', KEYS[1], 'round', r)
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'owner', ARGV[4], 'lease_until', now + tonumber(ARGV[5])) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reason', ARGV[2]) end
local ttl = tonumber(ARGV[3])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
return {1, cancel}
"""

# KEYS: hash. ARGV: owner, lease_ms, mode ('renew': only the owner; 'claim': only once expired;
# 'release': only the owner, the lease expires now and has no owner, so a late renew cannot revive it). Returns 1 when the caller held the lease (renew,
# release) or holds it now (claim).
_LEASE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
if ARGV[3] ~= 'claim' and owner ~= ARGV[1] then return 0 end
if ARGV[3] == 'claim' and lease > now then return 0 end
if ARGV[3] == 'release' then
  redis.call('HSET', KEYS[1], 'owner', '', 'lease_until', 0)
  return 1
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease_until', now + tonumber(ARGV[2]))
return 1
"""

# KEYS: hash, tokens, logprobs. ARGV: status, finish_reason, error, ttl_s. Only a running sequence changes.
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('NOTFOUND') end
if status ~= 'running' then return status end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finish_reason', ARGV[2], 'error', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[4]))
return ARGV[1]
"""

# KEYS: hash. Returns the status; a running sequence gets cancel=1.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('NOTFOUND') end
if status == 'running' then redis.call('HSET', KEYS[1], 'cancel', '1') end
return status
"""


class Tail(NamedTuple):
    """What Resume reads: the tokens from an index on, and the sequence's state."""
    tokens: list[int]
    status: Status
    finish_reason: str
    round_index: int
    error: str
    total: int  # tokens committed in all
    logprobs: list[str]  # an entry per token of `tokens` (stored_logprobs.py), or [] when none are stored


@dataclass(frozen=True, slots=True)
class SequenceParams:
    """A sequence's generation parameters, stored with it (the `params` field, JSON with these field
    names): a coordinator taking it over rebuilds its request from them, Resume its text deltas."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings (the text path; coordinator/text.py)
    skip_special_tokens: bool = True  # in the text deltas
    min_p: float = 0.0  # the target's sampling processors (services/spec/sampling.py SamplingParams)
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = off; k: the top k alternatives too

    def to_json(self) -> str:
        d = {f: getattr(self, f) for f in self.__slots__}
        return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in d.items()})

    @staticmethod
    def from_json(text: str) -> SequenceParams:
        """Records written before the text path have no `stop` / `skip_special_tokens`, before the
        drop-in sampling fields no `min_p` / `repetition_penalty` / `logprobs`: their defaults."""
        d = json.loads(text)
        logprobs = d.get("logprobs")
        return SequenceParams(int(d["max_new_tokens"]), float(d["temperature"]), float(d["top_p"]), int(d["top_k"]),
                              tuple(int(t) for t in d.get("stop_token_ids", ())), bool(d.get("ignore_eos", False)),
                              tuple(d.get("stop") or ()), bool(d.get("skip_special_tokens", True)),
                              float(d.get("min_p", 0.0)), float(d.get("repetition_penalty", 1.0)),
                              None if logprobs is None else int(logprobs))


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """What admission writes."""
    sequence_id: str
    prompt_ids: tuple[int, ...]
    params: SequenceParams
    seed: int
    drafter: str  # host:port, "" for plain decoding
    verifier: str
    owner: str = ""  # the coordinator holding the lease ("" = no lease)
    client: str = "anonymous"  # the identity that created it: only it may read, resume or cancel it


@dataclass(frozen=True, slots=True)
class SequenceState:
    """What any coordinator reads back."""
    sequence_id: str
    prompt_ids: list[int]
    tokens: list[int]  # every committed token
    status: Status
    finish_reason: str
    round_index: int  # the last committed round (hash field `round`), -1 before the prefill commits
    drafter: str
    verifier: str
    error: str = ""
    params: SequenceParams | None = None  # None: a record without parameters (not written by aerie)
    seed: int = 0
    owner: str = ""


@dataclass(frozen=True, slots=True)
class CommitResult:
    applied: bool  # False: this round was committed before (a retry), nothing changed
    cancel_requested: bool


class SequenceStore:
    """`ttl_s`: a running sequence's keys expire this long after its last update; `finished_ttl_s`:
    those of a finished, cancelled or failed one. `retry_s`: an unreachable Redis (restarting) is
    retried with backoff for this long before the call fails UNAVAILABLE; every write is idempotent
    (create checks existence, commit is keyed by round), so a retried write never applies twice."""

    def __init__(self, client: redis.Redis, ttl_s: int, finished_ttl_s: int | None = None,
                 retry_s: float = 0.0, lease_ttl_s: float = 10.0) -> None:
        self.redis = client
        self._probe: redis.Redis | None = None  # ping(timeout_s)'s own connection
        self._probe_timeout_s: float | None = None
        self.lease_ms = int(lease_ttl_s * 1000)
        self._indexed: dict[str, int] = {}  # sequence -> the lease expiry last indexed (ms), see _index_lease
        self.ttl_s = ttl_s
        self.finished_ttl_s = finished_ttl_s or ttl_s
        self.retry_s = retry_s
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)
        self._lease = client.register_script(_LEASE)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)

    @classmethod
    def from_url(cls, url: str, ttl_s: int, finished_ttl_s: int | None = None, retry_s: float = 0.0,
                 lease_ttl_s: float = 10.0) -> SequenceStore:
        from services.rpc.security import redis_password

        return cls(redis.Redis.from_url(url, decode_responses=True, socket_timeout=10, **redis_password(),
                                        socket_connect_timeout=5, health_check_interval=30),
                   ttl_s, finished_ttl_s, retry_s, lease_ttl_s)

    def _call(self, seq_id: str, fn, *args, **kwargs):
        """fn(*args) with domain errors; connection failures retried with backoff for retry_s."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                with _errors(seq_id):
                    return fn(*args, **kwargs)
            except DownstreamError:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    @staticmethod
    def keys(seq_id: str) -> tuple[str, str, str]:
        """(hash, tokens, logprobs)."""
        return f"{PREFIX}{{{seq_id}}}", f"{PREFIX}{{{seq_id}}}:tokens", f"{PREFIX}{{{seq_id}}}:logprobs"

    def ping(self, timeout_s: float | None = None) -> None:
        """PING; with `timeout_s`, over a connection of its own whose socket gives up after that long
        (a stalled Redis, e.g. SIGSTOPped, answers nothing: the store's own commands wait up to
        their 10 s socket timeout, a health check must not)."""
        with _errors(""):
            if timeout_s is None:
                self.redis.ping()
                return
            if self._probe is None or self._probe_timeout_s != timeout_s:
                pool = self.redis.connection_pool
                kwargs = dict(pool.connection_kwargs)
                for name in ("socket_timeout", "socket_connect_timeout", "orig_socket_timeout",
                             "orig_socket_connect_timeout"):
                    if name in kwargs or not name.startswith("orig_"):
                        kwargs[name] = timeout_s
                kwargs["retry"] = Retry(NoBackoff(), 0)  # one try: redis-py's default retries would multiply it
                kwargs.pop("health_check_interval", None)
                self._probe = redis.Redis(connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, max_connections=1, **kwargs))
                self._probe_timeout_s = timeout_s
            self._probe.ping()

    def create(self, rec: SequenceRecord) -> None:
        fields = {"prompt_ids": ",".join(map(str, rec.prompt_ids)), "params": rec.params.to_json(),
                  "seed": rec.seed, "round": -1, "status": "running", "finish_reason": "", "error": "",
                  "cancel": "0", "drafter": rec.drafter, "verifier": rec.verifier, "created": f"{time.time():.3f}",
                  "client": rec.client, "owner": rec.owner, "lease_until": int(time.time() * 1000) + self.lease_ms if rec.owner else 0}
        argv = [self.ttl_s] + [x for kv in fields.items() for x in kv]
        created = self._call(rec.sequence_id, self._create, keys=self.keys(rec.sequence_id)[:1], args=argv)
        if not created:
            raise SequenceExists(f"sequence {rec.sequence_id!r} already exists")
        if rec.owner:
            self._index_lease(rec.sequence_id, self.lease_ms)

    def commit(self, seq_id: str, round_index: int, tokens: list[int], finish_reason: str | None,
               owner: str = "", logprobs: list[str] | None = None) -> CommitResult:
        """Append one round's tokens (and its finish) atomically; a round already committed is a no-op.
        With `owner`, fenced by the sequence's lease (LeaseLost when another coordinator holds it)
        and renewing it. `logprobs`: one entry per token (coordinator/stored_logprobs.py), kept with them."""
        if logprobs and len(logprobs) != len(tokens):
            raise ValueError(f"{len(logprobs)} log-probability entries for {len(tokens)} tokens")
        ttl = self.finished_ttl_s if finish_reason else self.ttl_s
        applied, cancel = self._call(seq_id, self._commit, keys=self.keys(seq_id),
                                     args=[round_index, finish_reason or "", ttl, owner, self.lease_ms, len(tokens),
                                           *tokens, *(logprobs or ())])
        if owner:
            self._index_lease(seq_id, None if finish_reason else self.lease_ms)
        return CommitResult(bool(applied), bool(cancel))

    def finish(self, seq_id: str, status: Status, finish_reason: str = "", error: str = "") -> str:
        """End a running sequence (cancelled / failed); returns the final status."""
        final = self._call(seq_id, self._finish, keys=self.keys(seq_id),
                           args=[status, finish_reason, error[:2000], self.finished_ttl_s])
        self._index_lease(seq_id, None)
        return final

    # ---- leases (coordinator hand-over) ------------------------------------------------------------

    def renew(self, seq_id: str, owner: str) -> bool:
        """Extend `owner`'s lease; False when it lost it (another coordinator took the sequence over)."""
        held = bool(self._call(seq_id, self._lease, keys=self.keys(seq_id)[:1], args=[owner, self.lease_ms, "renew"]))
        if held:
            self._index_lease(seq_id, self.lease_ms)
        return held

    def claim(self, seq_id: str, owner: str) -> bool:
        """Take over a running sequence whose lease expired; True when `owner` holds it now."""
        held = bool(self._call(seq_id, self._lease, keys=self.keys(seq_id)[:1], args=[owner, self.lease_ms, "claim"]))
        if held:
            self._index_lease(seq_id, self.lease_ms)
        return held

    def hand_over(self, seq_id: str, owner: str) -> bool:
        """Let `owner`'s lease go now (a draining coordinator): any coordinator may claim the sequence
        at its next scan. False when `owner` did not hold it (or the sequence ended)."""
        released = bool(self._call(seq_id, self._lease, keys=self.keys(seq_id)[:1], args=[owner, 0, "release"]))
        if released:
            self._index_lease(seq_id, 0)
        return released

    def expired_leases(self, limit: int = 100) -> list[str]:
        """Running sequences whose lease ran out (their coordinator is gone): candidates for `claim`.
        The index (one sorted set, score = lease expiry in ms) is a hint; `claim` decides."""
        now_ms = int(time.time() * 1000)
        with _errors(""):
            ids = self.redis.zrangebyscore(LEASES, "-inf", now_ms, start=0, num=limit)
            gone = [i for i in ids if not self.redis.exists(self.keys(i)[0])]
            if gone:
                self.redis.zrem(LEASES, *gone)
        return [i for i in ids if i not in gone]

    def _index_lease(self, seq_id: str, lease_ms: int | None) -> None:
        """Index the lease's expiry (None: drop it). A renewal within a quarter of the lease of the
        last one indexed is skipped (a commit renews the lease every round, ~50 ms apart): the
        indexed expiry is then at most a quarter lease early, never late, so a scan finds an expired
        lease no later than before and `claim` still decides."""
        now_ms = int(time.time() * 1000)
        if lease_ms and now_ms + lease_ms - self._indexed.get(seq_id, 0) < lease_ms // 4:
            return
        try:
            if lease_ms is None:
                self.redis.zrem(LEASES, seq_id)
                self._indexed.pop(seq_id, None)
            else:
                self.redis.zadd(LEASES, {seq_id: now_ms + lease_ms})
                if lease_ms:
                    self._indexed[seq_id] = now_ms + lease_ms
                else:  # let go (hand-over): this coordinator indexes it no more
                    self._indexed.pop(seq_id, None)
        except redis.RedisError as e:  # the index is a hint; the lease itself is in the hash
            log.warning("cannot index the lease of %s: %s", seq_id, e)

    def set_placement(self, seq_id: str, drafter: str, verifier: str) -> None:
        """Record where the sequence runs now (after a fail-over)."""
        self._call(seq_id, self.redis.hset, self.keys(seq_id)[0], mapping={"drafter": drafter, "verifier": verifier})

    def client_of(self, seq_id: str) -> str:
        """The identity that created the sequence ("anonymous" for records written before it was kept)."""
        client, status = self._call(seq_id, self.redis.hmget, self.keys(seq_id)[0], "client", "status")
        if status is None:
            raise SequenceNotFound(f"unknown sequence {seq_id!r}")
        return client or "anonymous"

    def request_cancel(self, seq_id: str) -> Status:
        """Flag a running sequence for cancellation; returns its status."""
        with _errors(seq_id):
            return self._cancel(keys=self.keys(seq_id)[:1])

    def cancel_requested(self, seq_id: str) -> bool:
        """Whether a Cancel (through any coordinator) flagged the sequence; one read, no retries (a
        prefill asks before each chunk, and an unreachable Redis must not stall it)."""
        with _errors(seq_id):
            return self.redis.hget(self.keys(seq_id)[0], "cancel") == "1"

    def tail(self, seq_id: str, start: int) -> Tail:
        """The tokens from `start` on (and their log-probability entries, when stored), the status,
        finish_reason, round_index, error and number of tokens, in one round trip."""
        key, tokens_key, logprobs_key = self.keys(seq_id)

        def read():
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.hmget(key, "status", "finish_reason", "round", "error")
                pipe.lrange(tokens_key, start, -1)
                pipe.llen(tokens_key)
                pipe.lrange(logprobs_key, start, -1)
                return pipe.execute()
        (status, reason, round_index, error), tokens, total, logprobs = self._call(seq_id, read)
        if status is None:
            raise SequenceNotFound(f"unknown sequence {seq_id!r}")
        return Tail([int(t) for t in tokens], status, reason or "", int(round_index), error or "", int(total),
                    logprobs if len(logprobs) == len(tokens) else [])

    def get(self, seq_id: str) -> SequenceState:
        key, tokens_key, _ = self.keys(seq_id)
        with _errors(seq_id), self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.lrange(tokens_key, 0, -1)
            h, tokens = pipe.execute()
        if not h:
            raise SequenceNotFound(f"unknown sequence {seq_id!r}")
        prompt = h.get("prompt_ids", "")
        return SequenceState(
            sequence_id=seq_id, prompt_ids=[int(x) for x in prompt.split(",")] if prompt else [],
            tokens=[int(t) for t in tokens], status=h["status"], finish_reason=h.get("finish_reason", ""),
            round_index=int(h["round"]), drafter=h.get("drafter", ""), verifier=h.get("verifier", ""),
            error=h.get("error", ""), params=SequenceParams.from_json(h["params"]) if h.get("params") else None, seed=int(h.get("seed") or 0),
            owner=h.get("owner", ""))


@contextlib.contextmanager
def _errors(seq_id: str) -> Iterator[None]:
    """Script errors -> domain errors; an unreachable Redis -> UNAVAILABLE for the client."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise DownstreamError(grpc.StatusCode.UNAVAILABLE, f"Redis is unavailable: {e}") from None
    except redis.ResponseError as e:
        raise _store_error(seq_id, e) from None


SCRIPT_ERRORS = ("GAP", "ENDED")  # raised by the scripts above for a request that does not fit the sequence


def _store_error(seq_id: str, e: redis.ResponseError) -> Exception:
    text = str(e)
    if "NOTFOUND" in text:
        return SequenceNotFound(f"unknown sequence {seq_id!r}")
    if "LEASE" in text:
        return LeaseLost(f"sequence {seq_id!r}: {text}")
    if text.startswith(SCRIPT_ERRORS):
        return InvalidRequest(f"sequence {seq_id!r}: {text}")
    # Redis itself refused (read-only replica, NOREPLICAS, OOM, MISCONF, LOADING...): not the client's fault
    return DownstreamError(grpc.StatusCode.UNAVAILABLE, f"Redis refused the command for sequence {seq_id!r}: {text}")
