"""The continuous-batching flags shared by the verifier and the drafter services.

    --max-batch (AERIE_MAX_BATCH, 16)              calls gathered into one forward
    --max-batch-rows (AERIE_MAX_BATCH_ROWS, 1024)  rows (prompt tokens, tree nodes) per forward
    --batch-queue (AERIE_BATCH_QUEUE, 256)         calls waiting for a forward; more wait, then
    --batch-queue-timeout-s (AERIE_BATCH_QUEUE_TIMEOUT_S, 5)   RESOURCE_EXHAUSTED after this long
    --batch-wait-ms (AERIE_BATCH_WAIT_MS, 50)      longest wait for the other sequences' calls

docs/distributed.md "Batching" describes the policy.
"""

from __future__ import annotations

import argparse

from services.engine.batcher import BatchLimits
from services.errors import InvalidRequest
from services.rpc.config import ConfigError, env


def add_batch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("continuous batching")
    g.add_argument("--max-batch", type=int, default=env("AERIE_MAX_BATCH", 16),
                   help="calls gathered into one forward (AERIE_MAX_BATCH, 16; 1 = no batching)")
    g.add_argument("--max-batch-rows", type=int, default=env("AERIE_MAX_BATCH_ROWS", 1024),
                   help="rows (prompt tokens, tree nodes, decode tokens) per forward (AERIE_MAX_BATCH_ROWS, 1024)")
    g.add_argument("--batch-queue", type=int, default=env("AERIE_BATCH_QUEUE", 256),
                   help="calls waiting for a forward before new ones wait for a place (AERIE_BATCH_QUEUE, 256)")
    g.add_argument("--batch-queue-timeout-s", type=float, default=env("AERIE_BATCH_QUEUE_TIMEOUT_S", 5.0),
                   help="how long a call waits for a place in a full queue before RESOURCE_EXHAUSTED "
                        "(AERIE_BATCH_QUEUE_TIMEOUT_S, 5)")
    g.add_argument("--batch-wait-ms", type=float, default=env("AERIE_BATCH_WAIT_MS", 50.0),
                   help="longest wait for the calls of the other sequences holding state here, capped at half "
                        "the last forward's time (AERIE_BATCH_WAIT_MS, 50; 0 = never wait)")


def batch_limits(args: argparse.Namespace) -> BatchLimits:
    try:
        return BatchLimits(args.max_batch, args.max_batch_rows, args.batch_queue, args.batch_queue_timeout_s,
                           args.batch_wait_ms / 1000)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None
