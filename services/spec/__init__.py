"""The speculative-decoding algorithm: EAGLE-2 tree building, verification, sampling.

Pure tensor code: it never imports grpc, redis or OpenTelemetry and runs on CPU."""
