"""Redis sequence state against a real redis-server: commits are atomic, keyed by round index and
idempotent; cancel requests travel through Redis; records expire."""

import grpc
import pytest
import redis

from coordinator.redis_server import free_port
from coordinator.sequence_store import SequenceParams, SequenceRecord, SequenceStore
from services.errors import InvalidRequest, SequenceNotFound
from services.rpc.errors import DownstreamError, SequenceExists


@pytest.fixture
def store(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield SequenceStore(client, ttl_s=120)
    client.close()


def record(seq_id: str = "s1") -> SequenceRecord:
    return SequenceRecord(seq_id, (5, 6, 7), SequenceParams(10, 0.0, 1.0, 0), seed=3,
                          drafter="10.0.0.1:50053", verifier="10.0.0.2:50052")


def test_commits_are_idempotent_per_round(store):
    store.create(record())
    assert store.get("s1").round_index == -1 and store.get("s1").tokens == []
    assert store.commit("s1", 0, [11], None).applied
    assert store.commit("s1", 1, [12, 13, 14], None).applied
    # a retried commit of round 1 (even with different tokens) changes nothing
    assert not store.commit("s1", 1, [99, 98], None).applied
    assert not store.commit("s1", 0, [11], None).applied
    state = store.get("s1")
    assert state.tokens == [11, 12, 13, 14] and state.round_index == 1 and state.status == "running"
    with pytest.raises(InvalidRequest, match="GAP round 3 after round 1"):
        store.commit("s1", 3, [1], None)
    assert store.commit("s1", 2, [15], "length").applied
    state = store.get("s1")
    assert (state.tokens, state.status, state.finish_reason) == ([11, 12, 13, 14, 15], "finished", "length")
    assert state.prompt_ids == [5, 6, 7] and state.params == SequenceParams(10, 0.0, 1.0, 0)
    assert (state.drafter, state.verifier) == ("10.0.0.1:50053", "10.0.0.2:50052")
    with pytest.raises(InvalidRequest, match="sequence is finished"):
        store.commit("s1", 3, [16], None)
    assert store.get("s1").tokens == [11, 12, 13, 14, 15]


def test_keys_share_a_cluster_slot_and_expire(store):
    store.create(record("abc"))
    store.commit("abc", 0, [1], None, logprobs=['[-0.5,[],[]]'])
    key, tokens, logprobs = SequenceStore.keys("abc")
    assert (key, tokens, logprobs) == ("aerie:seq:{abc}", "aerie:seq:{abc}:tokens", "aerie:seq:{abc}:logprobs")
    assert all(0 < store.redis.ttl(k) <= 120 for k in (key, tokens, logprobs))


def test_logprobs_are_kept_aligned_with_their_tokens(store):
    from coordinator.stored_logprobs import from_rows, to_rows
    from services.spec.logprobs import TokenLogprobs
    import torch

    lp = TokenLogprobs(torch.tensor([7, 8]), torch.tensor([-0.25, -1.5]), torch.tensor([[7, 1], [3, 8]]),
                       torch.tensor([[-0.25, -2.0], [-0.5, -1.5]]))
    store.create(record("lp"))
    store.commit("lp", 0, [7], None, logprobs=to_rows(lp.head(1)))
    store.commit("lp", 1, [8], None, logprobs=to_rows(TokenLogprobs(*(t[1:] for t in (
        lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs)))))
    assert not store.commit("lp", 1, [8], None, logprobs=['[0,[],[]]']).applied  # a replayed round: nothing twice
    tail = store.tail("lp", 1)
    back = from_rows(tail.tokens, tail.logprobs)
    assert tail.tokens == [8] and back.top_ids.tolist() == [[3, 8]] and back.logprobs.tolist() == [-1.5]
    whole = store.tail("lp", 0)
    assert from_rows(whole.tokens, whole.logprobs).top_logprobs.tolist() == lp.top_logprobs.tolist()
    with pytest.raises(ValueError, match="1 log-probability entries for 2 tokens"):
        store.commit("lp", 2, [1, 2], None, logprobs=['[0,[],[]]'])


def test_create_twice_and_unknown_sequences(store):
    store.create(record())
    with pytest.raises(SequenceExists, match="sequence 's1' already exists"):
        store.create(record())
    for call in (lambda: store.get("nope"), lambda: store.commit("nope", 0, [1], None),
                 lambda: store.request_cancel("nope"), lambda: store.finish("nope", "failed")):
        with pytest.raises(SequenceNotFound, match="unknown sequence 'nope'"):
            call()


def test_cancel_requests_reach_the_next_commit(store):
    store.create(record())
    assert not store.commit("s1", 0, [1], None).cancel_requested
    assert store.request_cancel("s1") == "running"
    result = store.commit("s1", 1, [2, 3], None)
    assert result.applied and result.cancel_requested
    assert store.finish("s1", "cancelled", "cancel") == "cancelled"
    assert store.finish("s1", "failed", "error", "late") == "cancelled"  # only a running sequence changes
    assert store.request_cancel("s1") == "cancelled"
    state = store.get("s1")
    assert (state.status, state.finish_reason, state.tokens) == ("cancelled", "cancel", [1, 2, 3])


def test_unreachable_redis_is_unavailable():
    store = SequenceStore.from_url(f"redis://127.0.0.1:{free_port()}/0", ttl_s=10)
    with pytest.raises(DownstreamError, match="Redis is unavailable") as e:
        store.get("s1")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_finished_records_expire_sooner(redis_url):
    import redis as redis_lib
    store = SequenceStore(redis_lib.Redis.from_url(redis_url, decode_responses=True), ttl_s=120, finished_ttl_s=5)
    store.create(SequenceRecord("ttl-1", (1, 2), SequenceParams(4, 0.0, 1.0, 0), 0, "", "v:1"))
    store.commit("ttl-1", 0, [3], None)
    assert store.redis.ttl(store.keys("ttl-1")[0]) > 100  # running: the long TTL
    store.commit("ttl-1", 1, [4], "length")
    assert 0 < store.redis.ttl(store.keys("ttl-1")[0]) <= 5 and 0 < store.redis.ttl(store.keys("ttl-1")[1]) <= 5


def test_a_redis_restart_loses_nothing_and_writes_wait_for_it(tmp_path, monkeypatch):
    """kill -9 of an AOF Redis between two commits: the next commit retries with backoff until Redis
    is back on the same port and directory, and every committed token is still there.
    appendfsync always: Redis acknowledges a write after it is fsynced, so a kill loses no commit
    whatever the machine's load (under everysec a kill may lose the last ~2 s of writes, Redis's
    documented trade-off: the test slept 2.1 s past it and still depended on the load). Redis is
    restarted once the commit has failed and backs off (an event, not a timer)."""
    import signal
    import threading
    import time

    import redis as redis_lib

    from coordinator import sequence_store
    from coordinator.redis_server import start_redis, stop_process

    proc, url = start_redis(tmp_path / "r", appendfsync="always")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    store = SequenceStore(redis_lib.Redis.from_url(url, decode_responses=True, socket_timeout=2,
                                                   socket_connect_timeout=1), ttl_s=120, retry_s=120)
    store.create(SequenceRecord("aof-1", (1, 2), SequenceParams(4, 0.0, 1.0, 0), 0, "", "v:1"))
    store.commit("aof-1", 0, [3], None)
    store.commit("aof-1", 1, [4, 5], None)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    backed_off = threading.Event()

    class BackoffSeen:  # the store's clock, telling when it backs off after a failed attempt
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            backed_off.set()
            time.sleep(seconds)

    monkeypatch.setattr(sequence_store, "time", BackoffSeen)
    result: dict = {}
    commit = threading.Thread(target=lambda: result.update(r=store.commit("aof-1", 2, [6], None)))
    commit.start()
    restarted = None
    try:
        assert backed_off.wait(60), "the commit never found Redis down"
        restarted = start_redis(tmp_path / "r", port, appendfsync="always")[0]
        commit.join(120)
        assert result["r"].applied  # the commit waited for the restart
        assert store.get("aof-1").tokens == [3, 4, 5, 6] and store.get("aof-1").round_index == 2
    finally:
        commit.join(120)
        if restarted is not None:
            stop_process(restarted)


def test_a_lease_let_go_is_claimable_at_once_and_cannot_be_revived(store):
    """hand_over (a draining coordinator): only the owner can let its lease go; afterwards the
    sequence is in the expired index at once, the old owner cannot renew it (its late renew raced
    the hand-over), and another coordinator claims it."""
    store.create(SequenceRecord("h1", (1, 2), SequenceParams(4, 0.0, 1.0, 0), 0, "", "v:1", owner="a"))
    assert not store.claim("h1", "b")  # a's lease is live
    assert not store.hand_over("h1", "b")  # not b's to give
    assert store.hand_over("h1", "a")
    assert "h1" in store.expired_leases()
    assert not store.renew("h1", "a")
    assert store.claim("h1", "b") and store.get("h1").owner == "b"
    assert "h1" not in store.expired_leases()


def test_the_lease_index_is_written_once_per_quarter_lease_and_never_late(redis_url, monkeypatch):
    """Every commit renews the lease in the hash; the index (a hint for take-over scans) is written
    again only once the expiry moved by a quarter lease, so it is at most that early, never late
    (by the coordinator's clock), and a finished sequence leaves it. The coordinator's clock is a
    manual one here, 31.25 ms per round (exact in binary): the count of writes is exact, whatever the machine's load
    (it slept 20 ms per round and compared with Redis's clock within 20 ms before)."""
    import time as real_time

    from coordinator import sequence_store

    class Clock:  # the store's time module: wall time moves only when a round says so
        now = 1_800_000_000.0
        monotonic = staticmethod(real_time.monotonic)
        sleep = staticmethod(real_time.sleep)

        @classmethod
        def time(cls) -> float:
            return cls.now

    monkeypatch.setattr(sequence_store, "time", Clock)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    s = SequenceStore(client, ttl_s=120, lease_ttl_s=0.4)  # a quarter lease: 100 ms
    s.create(SequenceRecord("q1", (1, 2), SequenceParams(50, 0.0, 1.0, 0), 0, "", "v:1", owner="a"))
    writes = []
    real_zadd = client.zadd
    monkeypatch.setattr(client, "zadd", lambda *a, **k: writes.append(a) or real_zadd(*a, **k))
    for r in range(40):
        Clock.now += 1 / 32
        s.commit("q1", r, [7], None, owner="a")
        indexed = client.zscore(sequence_store.LEASES, "q1")
        now_ms = int(Clock.now * 1000)
        assert now_ms + 400 - 100 <= indexed <= now_ms + 400, r  # at most a quarter lease early, never late
    assert len(writes) == 10, writes  # 40 rounds x 31.25 ms = 1250 ms: every 4th round (125 ms >= 100)
    s.commit("q1", 40, [7], "length", owner="a")
    assert client.zscore(sequence_store.LEASES, "q1") is None
    client.close()


def test_params_round_trip_and_records_from_before_the_text_path_read():
    p = SequenceParams(7, 0.8, 0.9, 5, (2, 3), True, ("END",), False)
    assert SequenceParams.from_json(p.to_json()) == p
    old = '{"max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop_token_ids": [2], "ignore_eos": false}'
    assert SequenceParams.from_json(old) == SequenceParams(10, 0.0, 1.0, 0, (2,))


def test_the_drop_in_sampling_fields_round_trip_and_default_for_older_records():
    """min_p, repetition_penalty and logprobs are stored: a coordinator taking the sequence over
    rebuilds the same target distribution (and keeps returning logprobs)."""
    p = SequenceParams(7, 0.8, 0.9, 5, min_p=0.05, repetition_penalty=1.3, logprobs=2)
    assert SequenceParams.from_json(p.to_json()) == p
    assert SequenceParams.from_json(SequenceParams(7, 0.8, 0.9, 5, logprobs=0).to_json()).logprobs == 0
    before = '{"max_new_tokens": 10, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": ["x"]}'
    q = SequenceParams.from_json(before)
    assert (q.min_p, q.repetition_penalty, q.logprobs) == (0.0, 1.0, None)
