"""`aerie` command line: argparse -> validated config -> run. Thin by design.

    aerie generate --prompt "..."          one prompt in this process (or --coordinator HOST:PORT)
    aerie up                               the whole pipeline on this machine
    aerie verifier | drafter | coordinator one service
    aerie gateway --coordinators A,B       the HTTP API in front of coordinators (survives each one)
    aerie bench --prompts FILE             speed-ups on a prompt set
    aerie train-draft --out DIR            train an EAGLE head
    aerie draft-vocab --from FILES --out F token counts for --draft-vocab

Every aerie error (bad input, bad checkpoint, bad configuration) ends the process with exit code 2
and one line on stderr naming the offending value.
"""

from __future__ import annotations

import argparse
import os
import sys

from aerie_cli import bench, draft_vocab, gateway, generate, serve, train_draft, up
from aerie_cli.flags import HelpFormatter, set_torch_threads
from services.errors import AerieError


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("aerie")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aerie", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"aerie {version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.register(sub)
    up.register(sub)
    serve.register(sub)  # verifier, drafter, coordinator
    gateway.register(sub)
    train_draft.register(sub)
    bench.register(sub)
    draft_vocab.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        set_torch_threads()
        return args.func(args)
    except AerieError as e:
        print(f"aerie: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
