"""The verifier process: the target model and a KV per sequence behind the aerie.v1.Verifier API.

    aerie verifier --target DIR|FILE.gguf [--port 50052]       (or python -m verifier_svc)

A thin adapter over `services.engine.verifier.Verifier`, which it uses unchanged."""
