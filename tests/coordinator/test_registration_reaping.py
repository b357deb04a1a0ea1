"""Registration and reaping over a real Redis and real gRPC servers: a coordinator with no address
list places sequences on replicas that registered themselves, drops a replica whose heartbeat
stops, and picks up a new one without a restart; a drafter and a verifier release the KV of a
sequence whose coordinator went away (nobody touches it) after their idle TTL."""


from services.engine.engine import GenerationRequest
from services.rpc import registry
from services.rpc.coordinator_client import RemoteSession
from services.rpc.stubs import verifier as vpb
from tests.pipeline import local_engine, local_run, start_pipeline, wait_until

PROMPT = (5, 17, 99, 3, 42, 8)


def register(url, role, address, servicer, heartbeat_s=0.2, ttl_s=30.0):
    """A live registration: its record outlives 150 missed heartbeats (was 3: a loaded machine
    dropped live replicas); the test's one lapse (`ttl_s=2.0`) is a registration the test stops."""
    from aerie_cli.serve import describe_replica
    return registry.Registration(registry.connect(url), role, address, lambda: describe_replica(servicer),
                                 heartbeat_s, ttl_s).start()


def test_coordinator_discovers_registered_replicas(model_dirs, redis_url):
    p = start_pipeline(model_dirs, redis_url)
    regs = []
    try:
        regs.append(register(redis_url, "verifier", p.addresses["verifier"], p.verifier))
        regs.append(register(redis_url, "drafter", p.addresses["drafter"], p.drafter, ttl_s=2.0))
        found = registry.Registry(registry.connect(redis_url)).instances("drafter")
        assert found[p.addresses["drafter"]].draft == str(model_dirs.head)
        assert found[p.addresses["drafter"]].capacity == 8 and found[p.addresses["drafter"]].load == 0
        # no address list at all: everything comes from the registry
        coordinator, address = p.add_coordinator(redis_url, verifiers=(), drafters=(), discover_interval_s=0.1)
        session = RemoteSession(address, None, "", timeout_s=60)
        req = GenerationRequest(PROMPT, 30)
        tokens = [t for s in session.engine.generate(req) for t in s.tokens]
        assert tokens == local_run(local_engine(model_dirs), req)[0]
        assert session.placement == (p.addresses["drafter"], p.addresses["verifier"])
        # a missed heartbeat (the replica hangs or dies without unregistering): dropped from placement
        regs[1]._stop.set()
        regs[1]._thread.join()
        drafters = coordinator.sequences.drafters
        wait_until(lambda: p.addresses["drafter"] not in drafters.loads())
        tokens = [t for s in session.engine.generate(req) for t in s.tokens]
        assert tokens == local_run(local_engine(model_dirs), req)[0]  # plain rounds: same greedy tokens
        assert session.placement == ("", p.addresses["verifier"])
        # it registers again: placed there again, no restart
        regs[1] = register(redis_url, "drafter", p.addresses["drafter"], p.drafter)
        wait_until(lambda: p.addresses["drafter"] in drafters.loads())
        list(session.engine.generate(req))
        assert session.placement == (p.addresses["drafter"], p.addresses["verifier"])
        # unregistering on shutdown removes the record at once
        regs[1].stop()
        assert p.addresses["drafter"] not in registry.Registry(registry.connect(redis_url)).instances("drafter")
        session.close()
    finally:
        for r in regs:
            r._stop.set()
        p.close()


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_kv_of_an_abandoned_sequence_is_reaped(model_dirs, redis_url):
    """Idleness runs on a manual clock (the services' IdleSequences.clock): the live sequence is
    never idle for the TTL however long its rounds take on a loaded machine, the orphan is (before:
    a real 0.8 s, then 2 s, TTL and a wall-clock bound, which a slow round outlasted)."""
    p = start_pipeline(model_dirs, redis_url, idle_ttl_s=2.0)  # the reapers look every 0.5 s (real)
    clock = ManualClock()
    p.verifier.idle.clock = p.drafter.idle.clock = clock
    try:
        # a coordinator prefills on both services, then is never heard of again
        list(p.verifier_stub().Prefill(vpb.VerifierPrefillRequest(
            sequence_id="orphan", prompt_ids=list(PROMPT), capacity=64,
            feature_kind=vpb.FEATURE_KIND_HIDDEN if hasattr(vpb, "FEATURE_KIND_HIDDEN") else 1), timeout=30))
        clock.now = 1.0
        session = RemoteSession(p.addresses["coordinator"], None, "", timeout_s=60)
        steps = session.engine.generate(GenerationRequest(PROMPT, 200, ignore_eos=True))
        next(steps), next(steps)  # a live sequence on both services, in the middle of its rounds
        assert p.verifier.num_sequences == 2 and p.drafter.drafter.num_sequences == 1
        clock.now = 2.5  # the orphan: idle 2.5 s > 2; the live one: at most 1.5 s
        wait_until(lambda: p.verifier.num_sequences == 1)  # the orphan is released
        # the live sequence was touched every round: not reaped; stop it now
        assert p.drafter.drafter.num_sequences == 1
        steps.close()
        session.close()
        # and its KV goes too once abandoned mid-stream without a Release reaching the services
        def idle_and_reaped() -> bool:  # the clock moves 2.5 s per look: a round still in flight
            clock.now += 2.5  # (its touch) is idle by a later look
            return p.verifier.num_sequences == 0 and p.drafter.drafter.num_sequences == 0

        wait_until(idle_and_reaped)
        assert p.verifier.reaper.reaped >= 1
    finally:
        p.close()
