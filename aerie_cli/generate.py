"""`aerie generate`: one prompt, in this process or through a running pipeline.

    aerie generate --prompt "..." [--target DIR|FILE.gguf] [--draft DIR|none] [--json] ...
    aerie generate --coordinator HOST:PORT --prompt "..."     stream from `aerie up` / a cluster
    aerie generate --coordinator A:1,B:2 --prompt "..."       ... resuming on B when A drains or dies
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from aerie_cli.flags import add_command, add_model_flags, device, add_sampling_flags, dtype, parse_ids, tree_params
from services.errors import InvalidRequest
from services.rpc.config import env

RESUME_S = 60.0  # = services.rpc.coordinator_client.RESUME_S (not imported here: it pulls in grpc)


def register(sub: argparse._SubParsersAction) -> None:
    gen = add_command(sub, "generate", "generate from a prompt (in this process, or through --coordinator)",
                      __doc__)
    add_model_flags(gen)
    add_sampling_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--coordinator", default=env("AERIE_COORDINATOR"), metavar="HOST:PORT[,HOST:PORT...]",
                     help="stream from a running pipeline (aerie up / a cluster) instead of loading the models "
                          "here; --target then only names the tokenizer, which must be the served target's. "
                          "Several addresses: a stream whose coordinator drains or dies Resumes on the next one "
                          "(AERIE_COORDINATOR; default: load the models in this process)")
    gen.add_argument("--resume-s", type=float, default=env("AERIE_RESUME_S", RESUME_S), metavar="S",
                     help="with --coordinator: how long a broken stream keeps trying to Resume, with backoff, "
                          "before it fails; 0 = never (AERIE_RESUME_S; default: %(default)s)")
    gen.set_defaults(func=cmd_generate)


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


# flags that a running pipeline fixed when it started: -> where they are set instead
SET_BY_THE_PIPELINE = {
    "draft": "the drafter's head is set where it starts (aerie drafter --draft / AERIE_DRAFT, or aerie up --draft)",
    "dtype": "the services' dtype is set where they start (aerie verifier/drafter --dtype / AERIE_DTYPE, "
             "or aerie up --dtype)",
    "device": "the services' device is set where they start (aerie verifier/drafter --device / AERIE_DEVICE, "
              "or aerie up --device)",
    "tree_top_k": "the drafter's tree is set where it starts (aerie drafter --tree-top-k / AERIE_TREE_TOP_K, "
                  "or aerie up --tree-top-k)",
    "tree_depth": "the drafter's tree is set where it starts (aerie drafter --tree-depth / AERIE_TREE_DEPTH, "
                  "or aerie up --tree-depth)",
    "tree_tokens": "the drafter's tree is set where it starts (aerie drafter --tree-tokens / AERIE_TREE_TOKENS, "
                   "or aerie up --tree-tokens)",
}


def refuse_pipeline_fixed_flags(args: argparse.Namespace) -> None:
    for name, where in SET_BY_THE_PIPELINE.items():
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise InvalidRequest(f"{flag} does not apply with --coordinator: {where}")


def cmd_generate(args: argparse.Namespace) -> int:
    from services.engine.engine import GenerationRequest
    from services.spec.sampling import SamplingParams
    from services.text import IncrementalDetokenizer

    if args.coordinator:
        refuse_pipeline_fixed_flags(args)
        if args.resume_s < 0:
            raise InvalidRequest(f"--resume-s must be >= 0 (0 = never resume); got {args.resume_s:g}")
    tree = tree_params(args)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.prompt_ids is not None:
        parse_ids(args.prompt_ids, "--prompt-ids")  # fail before the slow model load
    t_load = time.perf_counter()
    if args.coordinator:  # stream from a running pipeline
        from services.rpc.coordinator_client import connect
        local = connect(args.coordinator, args.target, timeout_s=3600, resume_s=args.resume_s)
    else:
        from services.engine.local import build_local_engine
        local = build_local_engine(args.target, args.draft, dtype(args), tree, args.draft_vocab, args.draft_dtype,
                                   recalibrate=args.recalibrate, device=device(args))
    load_s = time.perf_counter() - t_load
    if args.coordinator and local.tokenizer is None and args.prompt_ids is None:
        raise InvalidRequest(f"the pipeline serves {local.target_path}, and there is no tokenizer for it on this "
                             f"machine: pass --target with a local copy of that model, or --prompt-ids")
    request = GenerationRequest(prompt_ids=encode_prompt(args, local.tokenizer),
                                max_new_tokens=args.max_new_tokens, sampling=sampling,
                                stop_token_ids=parse_ids(args.stop_token_ids, "--stop-token-ids"),
                                ignore_eos=args.ignore_eos)
    tokens: list[int] = []
    accepts: list[int] = []
    tree_sizes: list[int] = []  # nodes verified per round (0 = a round that drafted nothing)
    draft_s = verify_s = prefill_s = 0.0
    reason = None
    detok = IncrementalDetokenizer(local.tokenizer) if local.tokenizer is not None and not args.json else None
    t0 = time.perf_counter()
    for step in local.engine.generate(request):
        tokens += step.tokens
        reason = step.finish_reason
        if step.stats.accept_length == 0:
            pass  # a Resume stream's message: tokens without round statistics
        elif step.stats.round_index == 0:
            prefill_s = step.stats.verify_s
        else:
            accepts.append(step.stats.accept_length)
            tree_sizes.append(step.stats.tree_size)
            draft_s += step.stats.draft_s
            verify_s += step.stats.verify_s
        if detok is not None:  # special tokens never printed, multi-byte characters only once complete
            print(detok.push(step.tokens), end="", flush=True)
    if detok is not None:
        print(detok.flush(), end="")
    total_s = time.perf_counter() - t0
    text = local.tokenizer.decode(tokens, skip_special_tokens=True) if local.tokenizer else None
    decode_s = total_s - prefill_s
    tree = getattr(local, "tree", None) or tree  # a pipeline reports the tree its drafter grows
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
        "dtype": getattr(local, "dtype", None) or dtype(args),  # a pipeline reports what it serves
        "tree": None if local.draft_path is None and not any(tree_sizes) else
        {"mode": "auto" if tree is None else "fixed",  # auto: the budget chose every round's shape
         **({} if tree is None else {"top_k": tree.top_k, "depth": tree.depth, "tokens": tree.size}),
         "mean_tokens": round(sum(tree_sizes) / len(tree_sizes), 2) if tree_sizes else 0.0},
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
    if getattr(local, "resumes", 0):
        where = ", ".join(f"at token {i} on {a}" for a, i in local.resumed_at)
        print(f"[the coordinator became unavailable; resumed {local.resumes}x ({where}); tau counts only the "
              f"rounds streamed before the first break: a Resume stream carries no round statistics]", file=sys.stderr)
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
