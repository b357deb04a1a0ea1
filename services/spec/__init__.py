"""The speculative-decoding algorithm: EAGLE-2 tree building (tree.py), verification (verify.py),
sampling (sampling.py), retrieval (sam.py) and the draft budget: cost curves (cost.py), acceptance
statistics (acceptance.py), the batch's load (load_board.py), the chooser (budget.py).

Pure tensor code: it never imports grpc, redis or OpenTelemetry, does no file I/O (measuring and
caching cost curves: services/engine/calibration.py) and runs on CPU."""
