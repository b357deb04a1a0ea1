"""The OpenAI-compatible HTTP API (docs/clients.md): a client of the Coordinator's gRPC contract,
served by `aerie coordinator --http-port` (and so by `aerie up`) in the coordinator's process."""
