"""The gRPC edge shared by every aerie process: generated stubs (`stubs`), the one tensor/message
codec (`codec`), error mapping (`errors`), server and channel factories, tracing interceptors, and
the gRPC implementations of the engine's Drafter and Verifier roles (`clients`).

The algorithm (`services.spec`, `services.model`, `services.engine`) never imports this package."""
