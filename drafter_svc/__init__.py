"""The drafter process: an EAGLE head and a draft KV per sequence behind the aerie.v1.Drafter API.

    aerie drafter --draft HEAD_DIR [--target DIR|FILE.gguf] [--port 50053]   (or python -m drafter_svc)

A thin adapter over `services.engine.drafter.Drafter`, which it uses unchanged. The head needs the
target's embedding and lm_head, so the target checkpoint is loaded too."""
