"""`aerie` command line: argparse -> validated config -> run. Thin by design.

    aerie generate --prompt "..."          one prompt in this process (or --coordinator HOST:PORT)
    aerie serve [MODEL]                    the whole pipeline, vLLM's flags: the HTTP API on --port 8000
    aerie up                               the whole pipeline on this machine (--port: the gRPC API)
    aerie verifier | drafter | coordinator one service
    aerie gateway --coordinators A,B       the HTTP API in front of coordinators (survives each one)
    aerie bench --prompts FILE             speed-ups on a prompt set
    aerie bench serve --base-url URL       a serving benchmark against any OpenAI-compatible server
    aerie train-draft --out DIR            train an EAGLE head
    aerie draft-vocab --from FILES --out F token counts for --draft-vocab

Every aerie error ends the process with one line on stderr naming the offending value, and an exit
code that says which kind of failure it was (aerie_cli/exit_codes.py, docs/cli.md): 2 usage (bad
flag, input, configuration or checkpoint), 3 model unavailable, 4 server unreachable, 1 a failure
after the work started.
"""

from __future__ import annotations

import argparse
import os
import sys

from aerie_cli import bench, draft_vocab, gateway, generate, serve, serve_model, train_draft, up
from aerie_cli.exit_codes import exit_code
from aerie_cli.flags import HelpFormatter, finish_model_flags, set_torch_threads
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
    serve_model.register(sub)
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
        finish_model_flags(args)
        set_torch_threads()
        return args.func(args)
    except AerieError as e:
        print(f"aerie: error: {e}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt as e:
        return exit_code(e)
