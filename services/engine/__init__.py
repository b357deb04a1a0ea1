"""The in-process engine: a drafter and a verifier (local objects here, gRPC clients in the services)
driven by one round loop. See `engine.py`."""
