"""Drafter configuration: flags and AERIE_* variables -> DrafterConfig.

    AERIE_DRAFTER_PORT (50053), AERIE_TARGET, AERIE_DRAFT, AERIE_DTYPE (fp32), AERIE_TREE_TOP_K,
    AERIE_TREE_DEPTH, AERIE_TREE_TOKENS (unset: the auto budget, which the coordinator runs per round
    within services.spec.budget.AUTO_LARGEST; any of them: that fixed shape), AERIE_MAX_SEQUENCES (64),
    AERIE_AHEAD_BRANCHES (0; drafting ahead: services/spec/ahead_tree.py),
    the batching ones in services/rpc/batch_config.py and the common ones in services/rpc/config.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.errors import InvalidRequest
from services.engine.batcher import BatchLimits
from services.rpc import registry
from services.device import DEVICE_HELP, check_device
from services.rpc.batch_config import add_batch_flags, batch_limits
from services.rpc.config import DTYPE_NAMES, ConfigError, dtype_flag, ServiceConfig, add_service_flags, env, service_config
from services.spec.tree_flags import add_tree_aliases

if TYPE_CHECKING:  # the module builds `aerie drafter --help`: no torch at import
    from services.spec.tree import TreeParams

DEFAULT_PORT = 50053


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    service: ServiceConfig
    draft: str | None = None  # EAGLE head directory; None = the shipped head of the default model
    target: str | None = None  # the target the head belongs to (its embedding and lm_head)
    dtype: str | None = None  # None = the device's default (bf16 on a GPU, fp32 on the CPU)
    device: str | None = None  # cpu | cuda | cuda:N; None = AERIE_DEVICE, else cuda when available, else cpu
    draft_vocab: int | None = None  # None = the head's default (8192 with token counts), 0 = full
    draft_dtype: str | None = None  # fp32 | bf16 | int8; None = services.device.default_draft_dtype
    tree: TreeParams | None = None  # None = auto budget (the coordinator picks each round's shape)
    max_sequences: int = 64
    ahead_branches: int = 0  # drafting ahead: branches per attach point the draft KV reserves rows for

    idle_ttl_s: float = 600.0  # release a sequence untouched this long (its coordinator is gone); 0 = never
    batch: BatchLimits = BatchLimits()  # continuous batching (services/rpc/batch_config.py)
    max_tree_nodes: int = 512  # a Prefill's max_rows may reserve the target's context + this, never more

    def __post_init__(self) -> None:
        if not 2 <= self.max_tree_nodes <= 4096:  # 4096: services.rpc.codec.MAX_TREE_NODES
            raise ConfigError(f"max_tree_nodes must be in [2, 4096]; got {self.max_tree_nodes}")
        if self.idle_ttl_s < 0:
            raise ConfigError(f"idle_ttl_s must be >= 0; got {self.idle_ttl_s}")
        if self.device is not None:
            try:
                check_device(self.device)
            except InvalidRequest as e:
                raise ConfigError(str(e)) from None
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {list(DTYPE_NAMES)}; got {self.dtype!r}")
        if self.max_sequences < 1:
            raise ConfigError(f"max_sequences must be >= 1; got {self.max_sequences}")
        if not 0 <= self.ahead_branches <= 8:
            raise ConfigError(f"ahead_branches must be in [0, 8]; got {self.ahead_branches}")


def tree_flag(text: str) -> int | None:
    """A --tree-* value: an integer, or 'auto' / '' (the budget chooses)."""
    if text.strip().lower() in ("", "auto"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto'; got {text!r}") from None


def add_flags(p: argparse.ArgumentParser) -> None:
    registry.add_flags(p)  # optional: --redis-url registers this replica
    p.add_argument("--idle-ttl-s", type=float, default=env("AERIE_IDLE_TTL_S", 600.0),
                   help="release the KV of a sequence untouched this long (AERIE_IDLE_TTL_S, 600; 0 = never)")
    add_service_flags(p, "AERIE_DRAFTER_PORT", DEFAULT_PORT)
    g = p.add_argument_group("drafter")
    g.add_argument("--draft", default=env("AERIE_DRAFT"), help="EAGLE head directory (AERIE_DRAFT; default: the shipped head of the default model)")
    g.add_argument("--target", default=env("AERIE_TARGET"), help="target model of the head (AERIE_TARGET; default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", type=dtype_flag, default=env("AERIE_DTYPE"),
                   help="weights and activations (AERIE_DTYPE; default: bf16 on a GPU, fp32 on the CPU)")
    g.add_argument("--device", default=env("AERIE_DEVICE"), help=DEVICE_HELP)
    add_head_flags(g)
    g.add_argument("--max-sequences", type=int, default=env("AERIE_MAX_SEQUENCES", 64),
                   help="sequences holding draft KV at once (AERIE_MAX_SEQUENCES)")
    g.add_argument("--ahead-branches", type=int, default=env("AERIE_AHEAD_BRANCHES", 0),
                   help="drafting ahead: likely bonuses per attach point the ahead tree may grow a round-sized "
                        "subtree under; each sequence's draft KV reserves their rows (AERIE_AHEAD_BRANCHES; "
                        "default 0: the single ahead tree; `aerie up --overlap on|always` passes 2)")
    add_batch_flags(p)
    g.add_argument("--max-tree-nodes", type=int, default=env("AERIE_MAX_TREE_NODES", 512),
                   help="a sequence's draft KV may hold the target's context + this many rows (AERIE_MAX_TREE_NODES; default: 512)")


def add_head_flags(g) -> None:
    """The head's own flags, shared with a verifier that drafts too (verifier_svc/config.py --draft)."""
    g.add_argument("--draft-vocab", type=int, default=env("AERIE_DRAFT_VOCAB", None),
                   help="draft only the K most frequent tokens, 0 = full (AERIE_DRAFT_VOCAB; default: 8192 "
                        "when the head has token counts)")
    g.add_argument("--draft-dtype", choices=("fp32", "bf16", "int8"), default=env("AERIE_DRAFT_DTYPE", None),
                   help="the draft head's precision (AERIE_DRAFT_DTYPE; default: int8)")
    g.add_argument("--tree-top-k", type=tree_flag, default=env("AERIE_TREE_TOP_K"),
                   help="fixed shape: AERIE_TREE_TOP_K (default / 'auto': the coordinator's budget)")
    g.add_argument("--tree-depth", type=tree_flag, default=env("AERIE_TREE_DEPTH"),
                   help="fixed shape: AERIE_TREE_DEPTH (default / 'auto': the coordinator's budget)")
    g.add_argument("--tree-tokens", type=tree_flag, default=env("AERIE_TREE_TOKENS"),
                   help="fixed shape: AERIE_TREE_TOKENS (default / 'auto': the coordinator's budget)")
    add_tree_aliases(g)  # SGLang's --speculative-eagle-topk / -num-draft-tokens / -num-steps


def head_tree(args: argparse.Namespace) -> TreeParams | None:
    """The fixed tree of --tree-* (None: the coordinator's budget chooses)."""
    from services.spec.tree import TreeParams

    try:
        return TreeParams.from_flags(args.tree_top_k, args.tree_depth, args.tree_tokens)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


def from_args(args: argparse.Namespace) -> DrafterConfig:
    tree = head_tree(args)
    return DrafterConfig(service_config(args), draft=args.draft, target=args.target, dtype=args.dtype, device=args.device,
                         draft_vocab=args.draft_vocab, draft_dtype=args.draft_dtype, tree=tree, max_sequences=args.max_sequences,
                         max_tree_nodes=args.max_tree_nodes, ahead_branches=args.ahead_branches,
                         idle_ttl_s=args.idle_ttl_s, batch=batch_limits(args))
