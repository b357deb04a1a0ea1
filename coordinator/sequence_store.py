"""Durable sequence state in Redis: the only module that talks to Redis.

Layout (the `{id}` braces are a Redis Cluster hash tag: a sequence's two keys share a slot):

    aerie:seq:{id}          hash   prompt_ids (comma-separated), params (JSON), seed, round, status,
                                   finish_reason, error, cancel, drafter, verifier, created
    aerie:seq:{id}:tokens   list   every committed token, in order

`round` is the last committed round (-1 before the prefill commits). `commit` is one Lua script, so
a round's tokens, its index and a finish land atomically; it is keyed by round index, so a retried
commit of a round already there changes nothing. It also reports a pending cancel request, so a
cancel issued through any coordinator reaches the one driving the sequence without an extra round
trip. Both keys expire `ttl_s` after the last update.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import grpc
import redis

from services.errors import InvalidRequest, SequenceNotFound
from services.rpc.errors import DownstreamError, SequenceExists

Status = Literal["running", "finished", "cancelled", "failed"]
PREFIX = "aerie:seq:"

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""

# KEYS: hash, tokens. ARGV: round, finish_reason ('' = still running), ttl_s, tokens...
# Returns {applied (0|1), cancel requested (0|1)}.
_COMMIT = """
local cur = redis.call('HGET', KEYS[1], 'round')
if not cur then return redis.error_reply('NOTFOUND') end
local cancel = 0
if redis.call('HGET', KEYS[1], 'cancel') == '1' then cancel = 1 end
local r = tonumber(ARGV[1])
cur = tonumber(cur)
if r <= cur then return {0, cancel} end
if r ~= cur + 1 then return redis.error_reply('GAP round ' .. r .. ' after round ' .. cur) end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return redis.error_reply('ENDED sequence is ' .. status) end
if #ARGV > 3 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 4)) end
redis.call('HSET', KEYS[1], 'round', r)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reason', ARGV[2]) end
local ttl = tonumber(ARGV[3])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return {1, cancel}
"""

# KEYS: hash, tokens. ARGV: status, finish_reason, error, ttl_s. Only a running sequence changes.
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('NOTFOUND') end
if status ~= 'running' then return status end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finish_reason', ARGV[2], 'error', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
return ARGV[1]
"""

# KEYS: hash. Returns the status; a running sequence gets cancel=1.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('NOTFOUND') end
if status == 'running' then redis.call('HSET', KEYS[1], 'cancel', '1') end
return status
"""


@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """What admission writes."""
    sequence_id: str
    prompt_ids: tuple[int, ...]
    params: dict  # max_new_tokens, temperature, top_p, top_k, stop_token_ids, ignore_eos
    seed: int
    drafter: str  # host:port, "" for plain decoding
    verifier: str


@dataclass(frozen=True, slots=True)
class SequenceState:
    """What any coordinator reads back."""
    sequence_id: str
    prompt_ids: list[int]
    tokens: list[int]  # every committed token
    status: Status
    finish_reason: str
    round: int  # last committed round, -1 before the prefill commits
    drafter: str
    verifier: str
    error: str = ""
    params: dict = field(default_factory=dict)


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
                 retry_s: float = 0.0) -> None:
        self.redis = client
        self.ttl_s = ttl_s
        self.finished_ttl_s = finished_ttl_s or ttl_s
        self.retry_s = retry_s
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)

    @classmethod
    def from_url(cls, url: str, ttl_s: int, finished_ttl_s: int | None = None, retry_s: float = 0.0
                 ) -> SequenceStore:
        return cls(redis.Redis.from_url(url, decode_responses=True, socket_timeout=10,
                                        socket_connect_timeout=5, health_check_interval=30),
                   ttl_s, finished_ttl_s, retry_s)

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
    def keys(seq_id: str) -> tuple[str, str]:
        return f"{PREFIX}{{{seq_id}}}", f"{PREFIX}{{{seq_id}}}:tokens"

    def ping(self) -> None:
        with _errors(""):
            self.redis.ping()

    def create(self, rec: SequenceRecord) -> None:
        fields = {"prompt_ids": ",".join(map(str, rec.prompt_ids)), "params": json.dumps(rec.params),
                  "seed": rec.seed, "round": -1, "status": "running", "finish_reason": "", "error": "",
                  "cancel": "0", "drafter": rec.drafter, "verifier": rec.verifier, "created": f"{time.time():.3f}"}
        argv = [self.ttl_s] + [x for kv in fields.items() for x in kv]
        created = self._call(rec.sequence_id, self._create, keys=self.keys(rec.sequence_id)[:1], args=argv)
        if not created:
            raise SequenceExists(f"sequence {rec.sequence_id!r} already exists")

    def commit(self, seq_id: str, round_index: int, tokens: list[int], finish_reason: str | None) -> CommitResult:
        """Append one round's tokens (and its finish) atomically; a round already committed is a no-op."""
        ttl = self.finished_ttl_s if finish_reason else self.ttl_s
        applied, cancel = self._call(seq_id, self._commit, keys=self.keys(seq_id),
                                     args=[round_index, finish_reason or "", ttl, *tokens])
        return CommitResult(bool(applied), bool(cancel))

    def finish(self, seq_id: str, status: Status, finish_reason: str = "", error: str = "") -> str:
        """End a running sequence (cancelled / failed); returns the final status."""
        return self._call(seq_id, self._finish, keys=self.keys(seq_id),
                          args=[status, finish_reason, error[:2000], self.finished_ttl_s])

    def set_placement(self, seq_id: str, drafter: str, verifier: str) -> None:
        """Record where the sequence runs now (after a fail-over)."""
        self._call(seq_id, self.redis.hset, self.keys(seq_id)[0], mapping={"drafter": drafter, "verifier": verifier})

    def request_cancel(self, seq_id: str) -> Status:
        """Flag a running sequence for cancellation; returns its status."""
        with _errors(seq_id):
            return self._cancel(keys=self.keys(seq_id)[:1])

    def get(self, seq_id: str) -> SequenceState:
        key, tokens_key = self.keys(seq_id)
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
            round=int(h["round"]), drafter=h.get("drafter", ""), verifier=h.get("verifier", ""),
            error=h.get("error", ""), params=json.loads(h.get("params") or "{}"))


@contextlib.contextmanager
def _errors(seq_id: str) -> Iterator[None]:
    """Script errors -> domain errors; an unreachable Redis -> UNAVAILABLE for the client."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise DownstreamError(grpc.StatusCode.UNAVAILABLE, f"Redis is unavailable: {e}") from None
    except redis.ResponseError as e:
        raise _store_error(seq_id, e) from None


def _store_error(seq_id: str, e: redis.ResponseError) -> Exception:
    text = str(e)
    if "NOTFOUND" in text:
        return SequenceNotFound(f"unknown sequence {seq_id!r}")
    return InvalidRequest(f"sequence {seq_id!r}: {text}")
