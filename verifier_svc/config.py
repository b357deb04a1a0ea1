"""Verifier configuration: flags and AERIE_* variables -> VerifierConfig.

    AERIE_VERIFIER_PORT (50052), AERIE_TARGET, AERIE_DTYPE (fp32), AERIE_MAX_SEQUENCES (64),
    AERIE_MAX_PROMPT_TOKENS (8192), AERIE_MAX_TREE_NODES (512), AERIE_MAX_SEQUENCE_ROWS (the target's
    context + AERIE_MAX_TREE_NODES), the batching ones in services/rpc/batch_config.py and the common
    ones in services/rpc/config.py; AERIE_VERIFIER_DRAFT (--draft: a head served here too) with the
    drafter's AERIE_DRAFT_VOCAB, AERIE_DRAFT_DTYPE and AERIE_TREE_* (drafter_svc/config.py).

The two caps are the server's own caps on what a caller may make it allocate: a Prefill's `capacity`
(KV rows of one sequence) and a Verify's tree size. A caller cannot raise them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.engine.batcher import BatchLimits
from services.engine.kv_growth import GROWTH_ROWS
from services.rpc import registry
from services.errors import InvalidRequest
from services.device import DEVICE_HELP, check_device
from services.rpc.batch_config import add_batch_flags, batch_limits
from drafter_svc.config import DrafterConfig, add_head_flags, head_tree

MAX_TREE_NODES = 4096  # services.rpc.codec.MAX_TREE_NODES, the wire format's own bound (no torch import here)
from services.rpc.config import DTYPE_NAMES, ConfigError, dtype_flag, ServiceConfig, add_service_flags, env, service_config

DEFAULT_PORT = 50052
AUTO = "auto"  # --itl-target-ms auto: a step beside a prompt costs at most AUTO_RATIO plain steps (step_cost.py)
DEFAULT_MAX_SEQUENCES = 64  # the drafter's default too (drafter_svc/config.py)


@dataclass(frozen=True, slots=True)
class VerifierConfig:
    service: ServiceConfig
    target: str | None = None  # HF directory or .gguf; None = the default SmolLM2 GGUF
    dtype: str | None = None  # None = the device's default (bf16 on a GPU, fp32 on the CPU)
    device: str | None = None  # cpu | cuda | cuda:N; None = AERIE_DEVICE, else cuda when available, else cpu
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # sequences holding KV at once
    max_prompt_tokens: int = 8192  # longer prompts get RESOURCE_EXHAUSTED
    tp: int = 1  # tensor-parallel ranks (GPUs) of this verifier's group (services/dist)
    executor: str = "local"  # local: ranks as child processes; ray: Ray actors in a placement group
    tp_timeout_s: float = 30.0  # deadline of every collective: a dead rank -> UNAVAILABLE within it

    idle_ttl_s: float = 600.0  # release a sequence untouched this long (its coordinator is gone); 0 = never
    batch: BatchLimits = BatchLimits()  # continuous batching (services/rpc/batch_config.py)
    kv_budget_mb: float | None = None  # KV memory of all sequences; None = kv_budget_share of free memory
    kv_budget_share: float = 0.5  # without kv_budget_mb: this share of the device's free memory at start; 0 = unbounded
    kv_wait_s: float = 5.0  # how long a Prefill whose KV does not fit waits for KV to be released
    kv_queue: int = 64  # Prefills waiting for KV at once; more are refused at once
    kv_growth_rows: int = GROWTH_ROWS  # KV a Prefill reserves past its prompt, and each growth; 0 = the worst case
    prefill_chunk: int = 512  # prompt tokens per prefill forward (0 = the whole prompt in one)
    itl_target_ms: float | str = 0.0  # one step's target time (ms) for the step's token budget; "auto" = AUTO_RATIO plain steps; 0 = off (docs/distributed.md)
    kv_client_share: float = 0.5  # most of the KV budget one client identity holds while others want KV
    max_tree_nodes: int = 512  # largest tree a Verify may carry (the auto budget's largest is 32)
    max_sequence_rows: int | None = None  # most KV rows one sequence may reserve; None = context + one tree
    max_model_len: int | None = None  # prompt + new tokens of one sequence (vLLM's); None = the model's context
    gpu_memory_utilization: float | None = None  # CUDA: fraction of the GPU this process may fill (KV included)
    # --draft: a head this process serves too (its Drafter service on the same port, drafting the next
    # tree inside each Verify that asks: verifier_svc/servicer.py); None = the target alone
    drafter: DrafterConfig | None = None

    def __post_init__(self) -> None:
        if self.drafter is not None and self.tp > 1:
            raise ConfigError("--draft needs tp 1: a tensor-parallel group serves the target alone (run a drafter pool)")
        if self.kv_budget_mb is not None and not self.kv_budget_mb > 0:
            raise ConfigError(f"kv_budget_mb must be > 0 (or unset); got {self.kv_budget_mb}")
        if not 0 <= self.kv_budget_share <= 1:
            raise ConfigError(f"kv_budget_share must be in [0, 1] (0 = unbounded); got {self.kv_budget_share}")
        if not self.kv_wait_s >= 0:
            raise ConfigError(f"kv_wait_s must be >= 0; got {self.kv_wait_s}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk must be >= 0 (0 = off); got {self.prefill_chunk}")
        if self.itl_target_ms != AUTO and not (isinstance(self.itl_target_ms, (int, float)) and self.itl_target_ms >= 0):
            raise ConfigError(f"itl_target_ms must be {AUTO!r} or a number of ms >= 0 (0 = off); "
                              f"got {self.itl_target_ms!r}")
        if not 0 < self.kv_client_share <= 1:
            raise ConfigError(f"kv_client_share must be in (0, 1]; got {self.kv_client_share}")
        if self.kv_growth_rows < 0:
            raise ConfigError(f"kv_growth_rows must be >= 0 (0 = reserve the worst case); got {self.kv_growth_rows}")
        if self.kv_queue < 0:
            raise ConfigError(f"kv_queue must be >= 0; got {self.kv_queue}")
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
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 (a prompt token and a new one); got {self.max_model_len}")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ConfigError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
            if self.kv_budget_mb is not None:
                raise ConfigError("give --kv-budget-mb or --gpu-memory-utilization, not both: each sets the KV budget")


def add_flags(p: argparse.ArgumentParser) -> None:
    registry.add_flags(p)  # optional: --redis-url registers this replica
    p.add_argument("--idle-ttl-s", type=float, default=env("AERIE_IDLE_TTL_S", 600.0),
                   help="release the KV of a sequence untouched this long (AERIE_IDLE_TTL_S, 600; 0 = never)")
    add_service_flags(p, "AERIE_VERIFIER_PORT", DEFAULT_PORT)
    g = p.add_argument_group("verifier")
    g.add_argument("--target", default=env("AERIE_TARGET"),
                   help="target model: HF directory or .gguf (AERIE_TARGET; default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", type=dtype_flag, default=env("AERIE_DTYPE"),
                   help="weights and activations: auto, bf16, fp16 (CUDA only), fp32 or int8 (AERIE_DTYPE; default: "
                        "bf16 on a GPU, fp32 on the CPU)")
    g.add_argument("--device", default=env("AERIE_DEVICE"), help=DEVICE_HELP)
    g.add_argument("--tp", type=int, default=env("AERIE_TP_SIZE", 1),
                   help="tensor-parallel group size: the target sharded over this many ranks (AERIE_TP_SIZE)")
    g.add_argument("--executor", choices=("local", "ray"), default=env("AERIE_TP_EXECUTOR", "local"),
                   help="how the ranks start: local child processes, or Ray actors in a placement group "
                        "(AERIE_TP_EXECUTOR; ray joins the cluster at RAY_ADDRESS)")
    g.add_argument("--tp-timeout-s", type=float, default=env("AERIE_TP_TIMEOUT_S", 30.0),
                   help="deadline of every collective of the group: a dead rank gives UNAVAILABLE and health "
                        "NOT_SERVING within it (AERIE_TP_TIMEOUT_S)")
    g.add_argument("--max-sequences", type=int, default=env("AERIE_MAX_SEQUENCES", DEFAULT_MAX_SEQUENCES),
                   help="sequences holding KV at once (AERIE_MAX_SEQUENCES)")
    g.add_argument("--max-prompt-tokens", type=int, default=env("AERIE_MAX_PROMPT_TOKENS", 8192),
                   help="longest prompt accepted (AERIE_MAX_PROMPT_TOKENS)")
    add_batch_flags(p)
    g.add_argument("--kv-budget-mb", type=float, default=env("AERIE_KV_BUDGET_MB"),
                   help="KV memory for all sequences, MiB (AERIE_KV_BUDGET_MB; default: --kv-budget-share of the "
                        "device's free memory at start): a Prefill whose KV does not fit waits for KV to be "
                        "released, then RESOURCE_EXHAUSTED naming the budget")
    g.add_argument("--kv-budget-share", type=float, default=env("AERIE_KV_BUDGET_SHARE", 0.5),
                   help="without --kv-budget-mb: the share of the device's free memory (after the model is "
                        "loaded) that KV may use (AERIE_KV_BUDGET_SHARE; default: 0.5; 0 = unbounded)")
    g.add_argument("--kv-wait-s", type=float, default=env("AERIE_KV_WAIT_S", 5.0),
                   help="how long a Prefill waits for KV under the budget (AERIE_KV_WAIT_S, 5)")
    g.add_argument("--prefill-chunk", type=int, default=env("AERIE_PREFILL_CHUNK", 512),
                   help="prompt tokens per prefill call (the coordinator's chunk, each its own deadline) and, with "
                        "no sequence decoding here, per forward; other sequences' rounds run between the chunks "
                        "(AERIE_PREFILL_CHUNK; default: 512; 0 = off: the whole prompt in one forward)")
    g.add_argument("--itl-target-ms", type=itl_target, default=env("AERIE_ITL_TARGET_MS", 0.0),
                   help="inter-token latency target of one step: each step serves every running decode, then "
                        "prefill rows up to the budget whose predicted time (learned from the steps that ran) "
                        "fits this target: while a sequence decodes, a prefill chunk runs in budget-sized "
                        "slices, one per step; a number of ms (e.g. 400) or auto (3 plain steps) "
                        "(AERIE_ITL_TARGET_MS; default: 0 = off: arrival order, --prefill-chunk as given; off "
                        "because on a CPU it still trades a long prompt's TTFT for its neighbours' gaps, "
                        "docs/distributed.md)")
    g.add_argument("--kv-client-share", type=float, default=env("AERIE_KV_CLIENT_SHARE", 0.5),
                   help="most of the KV budget one client identity may hold while other identities hold or wait "
                        "for KV; alone it may use all of it (AERIE_KV_CLIENT_SHARE, 0.5)")
    g.add_argument("--kv-queue", type=int, default=env("AERIE_KV_QUEUE", 64),
                   help="Prefills waiting for KV at once; more are refused at once (AERIE_KV_QUEUE, 64)")
    g.add_argument("--kv-growth-rows", type=int, default=env("AERIE_KV_GROWTH_ROWS", GROWTH_ROWS),
                   help="KV rows a sequence reserves past its prompt at Prefill and adds each time it needs more; "
                        "when the budget is full the youngest sequence is preempted and prefilled again by its "
                        f"coordinator (AERIE_KV_GROWTH_ROWS; default: {GROWTH_ROWS}; 0 = reserve prompt + max "
                        "tokens + one tree at Prefill, never preempt)")
    g.add_argument("--max-model-len", type=int, default=env("AERIE_MAX_MODEL_LEN"),
                   help="the most tokens one sequence may span, prompt + new tokens (vLLM's flag; "
                        "AERIE_MAX_MODEL_LEN; default: the model's context; more than it is refused at start)")
    g.add_argument("--gpu-memory-utilization", type=float, default=env("AERIE_GPU_MEMORY_UTILIZATION"),
                   help="vLLM's flag. On CUDA: the fraction of the GPU's total memory this process may fill; the KV "
                        "budget is that minus the memory in use after the model loaded. On the CPU: accepted, NO "
                        "effect (a warning; --kv-budget-share applies) (AERIE_GPU_MEMORY_UTILIZATION; default: "
                        "--kv-budget-share of the free memory)")
    g.add_argument("--max-tree-nodes", type=int, default=env("AERIE_MAX_TREE_NODES", 512),
                   help="largest draft tree a Verify may carry (AERIE_MAX_TREE_NODES; default: 512)")
    d = p.add_argument_group("drafting here (one process for both roles: a verifier that serves a head too)")
    d.add_argument("--draft", default=env("AERIE_VERIFIER_DRAFT"),
                   help="EAGLE head directory of this target: serve the Drafter API on this port too and draft "
                        "each next tree inside the Verify call (AERIE_VERIFIER_DRAFT; default: none, the "
                        "target alone; `aerie up --colocate` passes it)")
    add_head_flags(d)
    g.add_argument("--max-sequence-rows", type=int, default=env("AERIE_MAX_SEQUENCE_ROWS"),
                   help="most KV rows one sequence may reserve (AERIE_MAX_SEQUENCE_ROWS; default: the target's "
                        "context + --max-tree-nodes)")


def itl_target(value: str) -> float | str:
    """--itl-target-ms: "auto" or a number of ms >= 0."""
    if str(value).strip().lower() == AUTO:
        return AUTO
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {AUTO!r} or a number of ms >= 0 (0 = off); got {value!r}") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"must be {AUTO!r} or a number of ms >= 0 (0 = off); got {value!r}")
    return ms


def from_args(args: argparse.Namespace) -> VerifierConfig:
    return VerifierConfig(service_config(args), target=args.target, dtype=args.dtype, device=args.device,
                          max_sequences=args.max_sequences, max_prompt_tokens=args.max_prompt_tokens,
                          idle_ttl_s=args.idle_ttl_s, max_tree_nodes=args.max_tree_nodes,
                          max_sequence_rows=args.max_sequence_rows, batch=batch_limits(args),
                          kv_budget_mb=args.kv_budget_mb, kv_budget_share=args.kv_budget_share, kv_wait_s=args.kv_wait_s, kv_queue=args.kv_queue,
                          kv_growth_rows=args.kv_growth_rows,
                          prefill_chunk=args.prefill_chunk, itl_target_ms=args.itl_target_ms,
                          kv_client_share=args.kv_client_share, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          tp=args.tp, executor=args.executor, tp_timeout_s=args.tp_timeout_s,
                          drafter=head_config(args))


def head_config(args: argparse.Namespace) -> DrafterConfig | None:
    """--draft: the head's configuration, on this verifier's port, model, device and limits."""
    if not args.draft:
        return None
    return DrafterConfig(service_config(args), draft=args.draft, target=args.target, dtype=args.dtype,
                         device=args.device, draft_vocab=args.draft_vocab, draft_dtype=args.draft_dtype,
                         tree=head_tree(args), max_sequences=args.max_sequences, max_tree_nodes=args.max_tree_nodes,
                         idle_ttl_s=args.idle_ttl_s, batch=batch_limits(args))
