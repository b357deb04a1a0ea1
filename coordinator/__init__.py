"""The coordinator process: the public aerie.v1.Coordinator API, the round loop for many sequences,
durable sequence state in Redis, and placement across the drafter and verifier pools.

    aerie coordinator --verifiers HOST:PORT[,...] [--drafters HOST:PORT[,...]] --redis-url URL
    aerie up ...        everything on one machine (coordinator/up.py)

It is the only code that talks to Redis. The round semantics are `services.engine.engine.Engine`'s,
driven over gRPC clients of the drafter and verifier (services/rpc/clients.py)."""
