"""Verifier configuration: flags and AERIE_* variables -> VerifierConfig.

    AERIE_VERIFIER_PORT (50052), AERIE_TARGET, AERIE_DTYPE (fp32), AERIE_MAX_SEQUENCES (64),
    AERIE_MAX_PROMPT_TOKENS (8192), AERIE_MAX_TREE_NODES (512), AERIE_MAX_SEQUENCE_ROWS (the target's
    context + AERIE_MAX_TREE_NODES), the batching ones in services/rpc/batch_config.py and the common
    ones in services/rpc/config.py.

The two caps are the server's own caps on what a caller may make it allocate: a Prefill's `capacity`
(KV rows of one sequence) and a Verify's tree size. A caller cannot raise them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.engine.batcher import BatchLimits
from services.rpc import registry
from services.errors import InvalidRequest
from services.device import DEVICE_HELP, check_device
from services.rpc.batch_config import add_batch_flags, batch_limits

MAX_TREE_NODES = 4096  # services.rpc.codec.MAX_TREE_NODES, the wire format's own bound (no torch import here)
from services.rpc.config import DTYPE_NAMES, ConfigError, ServiceConfig, add_service_flags, env, service_config

DEFAULT_PORT = 50052


@dataclass(frozen=True, slots=True)
class VerifierConfig:
    service: ServiceConfig
    target: str | None = None  # HF directory or .gguf; None = the default SmolLM2 GGUF
    dtype: str | None = None  # None = the device's default (bf16 on a GPU, fp32 on the CPU)
    device: str | None = None  # cpu | cuda | cuda:N; None = AERIE_DEVICE, else cuda when available, else cpu
    max_sequences: int = 64  # sequences holding KV at once
    max_prompt_tokens: int = 8192  # longer prompts get RESOURCE_EXHAUSTED
    tp: int = 1  # tensor-parallel ranks (GPUs) of this verifier's group (services/dist)
    executor: str = "local"  # local: ranks as child processes; ray: Ray actors in a placement group
    tp_timeout_s: float = 30.0  # deadline of every collective: a dead rank -> UNAVAILABLE within it

    idle_ttl_s: float = 600.0  # release a sequence untouched this long (its coordinator is gone); 0 = never
    batch: BatchLimits = BatchLimits()  # continuous batching (services/rpc/batch_config.py)
    max_tree_nodes: int = 512  # largest tree a Verify may carry (the auto budget's largest is 32)
    max_sequence_rows: int | None = None  # most KV rows one sequence may reserve; None = context + one tree

    def __post_init__(self) -> None:
        if not 2 <= self.max_tree_nodes <= MAX_TREE_NODES:
            raise ConfigError(f"max_tree_nodes must be in [2, {MAX_TREE_NODES}]; got {self.max_tree_nodes}")
        if self.max_sequence_rows is not None and self.max_sequence_rows < 2:
            raise ConfigError(f"max_sequence_rows must be >= 2; got {self.max_sequence_rows}")
        if self.idle_ttl_s < 0:
            raise ConfigError(f"idle_ttl_s must be >= 0; got {self.idle_ttl_s}")
        if self.device is not None:
            try:
                check_device(self.device)
            except InvalidRequest as e:
                raise ConfigError(str(e)) from None
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {list(DTYPE_NAMES)}; got {self.dtype!r}")
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1; got {self.tp}")
        if self.executor not in ("local", "ray"):
            raise ConfigError(f"executor must be local or ray; got {self.executor!r}")
        if self.tp_timeout_s <= 0:
            raise ConfigError(f"tp_timeout_s must be > 0; got {self.tp_timeout_s}")
        if self.max_sequences < 1:
            raise ConfigError(f"max_sequences must be >= 1; got {self.max_sequences}")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"max_prompt_tokens must be >= 1; got {self.max_prompt_tokens}")


def add_flags(p: argparse.ArgumentParser) -> None:
    registry.add_flags(p)  # optional: --redis-url registers this replica
    p.add_argument("--idle-ttl-s", type=float, default=env("AERIE_IDLE_TTL_S", 600.0),
                   help="release the KV of a sequence untouched this long (AERIE_IDLE_TTL_S, 600; 0 = never)")
    add_service_flags(p, "AERIE_VERIFIER_PORT", DEFAULT_PORT)
    g = p.add_argument_group("verifier")
    g.add_argument("--target", default=env("AERIE_TARGET"),
                   help="target model: HF directory or .gguf (AERIE_TARGET; default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=DTYPE_NAMES, default=env("AERIE_DTYPE"),
                   help="weights and activations (AERIE_DTYPE; default: bf16 on a GPU, fp32 on the CPU)")
    g.add_argument("--device", default=env("AERIE_DEVICE"), help=DEVICE_HELP)
    g.add_argument("--tp", type=int, default=env("AERIE_TP_SIZE", 1),
                   help="tensor-parallel group size: the target sharded over this many ranks (AERIE_TP_SIZE)")
    g.add_argument("--executor", choices=("local", "ray"), default=env("AERIE_TP_EXECUTOR", "local"),
                   help="how the ranks start: local child processes, or Ray actors in a placement group "
                        "(AERIE_TP_EXECUTOR; ray joins the cluster at RAY_ADDRESS)")
    g.add_argument("--tp-timeout-s", type=float, default=env("AERIE_TP_TIMEOUT_S", 30.0),
                   help="deadline of every collective of the group: a dead rank gives UNAVAILABLE and health "
                        "NOT_SERVING within it (AERIE_TP_TIMEOUT_S)")
    g.add_argument("--max-sequences", type=int, default=env("AERIE_MAX_SEQUENCES", 64),
                   help="sequences holding KV at once (AERIE_MAX_SEQUENCES)")
    g.add_argument("--max-prompt-tokens", type=int, default=env("AERIE_MAX_PROMPT_TOKENS", 8192),
                   help="longest prompt accepted (AERIE_MAX_PROMPT_TOKENS)")
    add_batch_flags(p)
    g.add_argument("--max-tree-nodes", type=int, default=env("AERIE_MAX_TREE_NODES", 512),
                   help="largest draft tree a Verify may carry (AERIE_MAX_TREE_NODES; default: 512)")
    g.add_argument("--max-sequence-rows", type=int, default=env("AERIE_MAX_SEQUENCE_ROWS"),
                   help="most KV rows one sequence may reserve (AERIE_MAX_SEQUENCE_ROWS; default: the target's "
                        "context + --max-tree-nodes)")


def from_args(args: argparse.Namespace) -> VerifierConfig:
    return VerifierConfig(service_config(args), target=args.target, dtype=args.dtype, device=args.device,
                          max_sequences=args.max_sequences, max_prompt_tokens=args.max_prompt_tokens,
                          idle_ttl_s=args.idle_ttl_s, max_tree_nodes=args.max_tree_nodes,
                          max_sequence_rows=args.max_sequence_rows, batch=batch_limits(args),
                          tp=args.tp, executor=args.executor, tp_timeout_s=args.tp_timeout_s)
