"""Placement: least loaded, sticky until release, re-resolved host names, dead replicas skipped."""

import threading

import grpc
import pytest

from coordinator.config import parse_endpoints
from coordinator.placement import Pool, Refresher, resolve_entry
from services.rpc.config import ConfigError
from services.rpc.errors import DownstreamError
from tests.pipeline import wait_until


class FakeClient:
    def __init__(self, address: str, up: bool = True) -> None:
        self.address, self.up, self.closed = address, up, False

    def info(self):
        if not self.up:
            raise DownstreamError(grpc.StatusCode.UNAVAILABLE, f"verifier at {self.address} is unavailable")
        return object()

    def close(self):
        self.closed = True


def test_least_loaded_and_rescaling():
    dns = {"verifier-headless:50052": {"10.0.0.1:50052", "10.0.0.2:50052"}}
    clients = {}
    pool = Pool("verifier", ["verifier-headless:50052"], lambda a: clients.setdefault(a, FakeClient(a)),
                resolve=lambda e: set(dns[e]))
    a, b = pool.acquire(), pool.acquire()
    assert {a.address, b.address} == {"10.0.0.1:50052", "10.0.0.2:50052"}
    pool.release(a)
    assert pool.acquire() is a  # now the least loaded
    # the headless service gains a pod and loses one: no restart needed
    dns["verifier-headless:50052"] = {"10.0.0.2:50052", "10.0.0.3:50052"}
    pool.refresh()
    assert pool.acquire().address == "10.0.0.3:50052"
    assert not clients["10.0.0.1:50052"].closed  # still serving a sequence
    pool.release(clients["10.0.0.1:50052"])
    assert clients["10.0.0.1:50052"].closed  # retired and idle
    assert set(pool.loads()) == {"10.0.0.2:50052", "10.0.0.3:50052"}


def test_dead_replicas_are_skipped_and_dns_errors_keep_the_last_answer():
    answers = [{"10.0.0.1:1", "10.0.0.2:1"}]

    def resolve(entry):
        if answers[-1] is None:
            raise OSError("temporary failure in name resolution")
        return answers[-1]

    pool = Pool("drafter", ["d:1"], lambda a: FakeClient(a, up=a != "10.0.0.1:1"), resolve=resolve)
    assert pool.acquire().address == "10.0.0.2:1"
    assert pool.acquire().address == "10.0.0.2:1"
    answers.append(None)
    pool.refresh()
    assert set(pool.loads()) == {"10.0.0.1:1", "10.0.0.2:1"}
    empty = Pool("drafter", ["d:1"], lambda a: FakeClient(a, up=False), resolve=lambda e: {"10.0.0.9:1"})
    with pytest.raises(DownstreamError, match="no drafter available: verifier at 10.0.0.9:1 is unavailable") as e:
        empty.acquire()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_endpoint_parsing_and_resolution():
    assert parse_endpoints(" a:1, b:2 ,", "x") == ("a:1", "b:2")
    assert resolve_entry("127.0.0.1:50052") == {"127.0.0.1:50052"}
    assert resolve_entry("[::1]:50052") == {"[::1]:50052"}
    local = resolve_entry("localhost:50052")
    assert local and local <= {"127.0.0.1:50052", "[::1]:50052"}  # non-empty: `<=` alone passes for set()
    for bad in ("a", "a:b", ":1", "a:70000"):
        with pytest.raises(ConfigError, match="x entries must be host:port"):
            parse_endpoints(bad, "x")


def test_refresher_re_resolves_on_its_own_and_stops():
    dns = {"v:1": {"10.0.0.1:1"}}
    resolved = threading.Event()

    def resolve(entry):
        resolved.set()
        return set(dns[entry])

    pool = Pool("verifier", ["v:1"], FakeClient, resolve=resolve)
    before = set(threading.enumerate())
    refresher = Refresher([pool], 0.01)
    (thread,) = set(threading.enumerate()) - before
    try:
        dns["v:1"] = {"10.0.0.1:1", "10.0.0.2:1"}  # a pod joins; nobody calls refresh()
        wait_until(lambda: set(pool.loads()) == {"10.0.0.1:1", "10.0.0.2:1"})
        dns["v:1"] = {"10.0.0.2:1"}  # and one leaves
        wait_until(lambda: set(pool.loads()) == {"10.0.0.2:1"})
    finally:
        refresher.stop()
    assert thread.name == "pool-refresh" and not thread.is_alive()
    resolved.clear()
    dns["v:1"] = {"10.0.0.3:1"}
    assert not resolved.wait(0.1) and set(pool.loads()) == {"10.0.0.2:1"}  # stopped: no more resolving
