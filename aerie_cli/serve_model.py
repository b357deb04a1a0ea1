"""`aerie serve [MODEL]`: the pipeline of `aerie up`, started with the flags vLLM and SGLang users type.

    aerie serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8000 --dtype auto
    aerie serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2 \\
        --speculative-algorithm EAGLE --speculative-draft-model-path yuhuili/EAGLE-LLaMA3.1-Instruct-8B
    aerie serve MODEL --speculative-config '{"method": "eagle", "model": "HEAD", "num_speculative_tokens": 5}'

The same stack as `aerie up` (Redis, verifiers, drafters, coordinators; coordinator/up.py), with one
difference in names: --port is the OpenAI-compatible HTTP API (vLLM's meaning, default 8000) and the
coordinator's gRPC API moves to --grpc-port (default 50051). MODEL is a Hugging Face directory, a .gguf
file or a Hub id (the local HF cache, else a download; --download-dir, HF_TOKEN); --model/--model-path
name it too. Left out: the default model (SmolLM2-135M-Instruct) with its shipped EAGLE head. Every
`aerie up` flag works here as well; docs/cli.md lists the vLLM and SGLang names that map onto aerie's.
"""

from __future__ import annotations

import argparse

from aerie_cli.flags import add_command, add_model_flags
from coordinator.config import DEFAULT_PORT
from services.rpc.config import env


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", "serve a model behind an OpenAI-compatible API (vLLM's flags; aerie up's stack)",
                    __doc__)
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="a Hugging Face directory, .gguf file or Hub id ORG/NAME (default: --model, else "
                        "SmolLM2-135M-Instruct)")
    add_model_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--port", dest="http_port", type=int, default=env("AERIE_HTTP_PORT", 8000),
                   help="the OpenAI-compatible HTTP API's port (vLLM's --port), 0 = any free port (AERIE_HTTP_PORT)")
    g.add_argument("--grpc-port", dest="port", type=int, default=env("AERIE_COORDINATOR_PORT", DEFAULT_PORT),
                   help="the coordinator's gRPC API port (aerie up's --port), 0 = any free port "
                        "(AERIE_COORDINATOR_PORT)")
    from aerie_cli.up import add_pipeline_flags

    add_pipeline_flags(p, g)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from aerie_cli.up import cmd_up

    # MODEL is already in args.target (flags.finish_model_flags, which refuses MODEL and a different --model)
    if args.served_model_name is None and args.model_name is not None:
        args.served_model_name = [args.model_name]  # vLLM's default: the model as given
    return cmd_up(args)
