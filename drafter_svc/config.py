"""Drafter configuration: flags and AERIE_* variables -> DrafterConfig.

    AERIE_DRAFTER_PORT (50053), AERIE_TARGET, AERIE_DRAFT, AERIE_DTYPE (fp32), AERIE_TREE_TOP_K (10),
    AERIE_TREE_DEPTH (5), AERIE_TREE_TOKENS (60), AERIE_MAX_SEQUENCES (64), and the common ones in
    services/rpc/config.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from services.engine.local import DTYPES
from services.errors import InvalidRequest
from services.rpc import registry
from services.rpc.config import ConfigError, ServiceConfig, add_service_flags, env, service_config
from services.spec.tree import TreeParams

DEFAULT_PORT = 50053


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    service: ServiceConfig
    draft: str | None = None  # EAGLE head directory; None = the shipped head of the default model
    target: str | None = None  # the target the head belongs to (its embedding and lm_head)
    dtype: str = "fp32"
    tree: TreeParams = field(default_factory=TreeParams)
    max_sequences: int = 64

    idle_ttl_s: float = 600.0  # release a sequence untouched this long (its coordinator is gone); 0 = never

    def __post_init__(self) -> None:
        if self.idle_ttl_s < 0:
            raise ConfigError(f"idle_ttl_s must be >= 0; got {self.idle_ttl_s}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if self.max_sequences < 1:
            raise ConfigError(f"max_sequences must be >= 1; got {self.max_sequences}")


def add_flags(p: argparse.ArgumentParser) -> None:
    registry.add_flags(p)  # optional: --redis-url registers this replica
    p.add_argument("--idle-ttl-s", type=float, default=env("AERIE_IDLE_TTL_S", 600.0),
                   help="release the KV of a sequence untouched this long (AERIE_IDLE_TTL_S, 600; 0 = never)")
    add_service_flags(p, "AERIE_DRAFTER_PORT", DEFAULT_PORT)
    g = p.add_argument_group("drafter")
    g.add_argument("--draft", default=env("AERIE_DRAFT"), help="EAGLE head directory (AERIE_DRAFT)")
    g.add_argument("--target", default=env("AERIE_TARGET"), help="target model of the head (AERIE_TARGET)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=env("AERIE_DTYPE", "fp32"), help="AERIE_DTYPE (fp32)")
    g.add_argument("--tree-top-k", type=int, default=env("AERIE_TREE_TOP_K", 10), help="AERIE_TREE_TOP_K (10)")
    g.add_argument("--tree-depth", type=int, default=env("AERIE_TREE_DEPTH", 5), help="AERIE_TREE_DEPTH (5)")
    g.add_argument("--tree-tokens", type=int, default=env("AERIE_TREE_TOKENS", 60), help="AERIE_TREE_TOKENS (60)")
    g.add_argument("--max-sequences", type=int, default=env("AERIE_MAX_SEQUENCES", 64),
                   help="sequences holding draft KV at once (AERIE_MAX_SEQUENCES, 64)")


def from_args(args: argparse.Namespace) -> DrafterConfig:
    try:
        tree = TreeParams(args.tree_top_k, args.tree_depth, args.tree_tokens)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None
    return DrafterConfig(service_config(args), draft=args.draft, target=args.target, dtype=args.dtype,
                         tree=tree, max_sequences=args.max_sequences, idle_ttl_s=args.idle_ttl_s)
