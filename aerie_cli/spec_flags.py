"""SGLang's and vLLM's speculative-decoding flags, mapped onto aerie's --draft and --tree-* flags.

    SGLang                                          aerie
    --speculative-algorithm EAGLE | EAGLE3          --draft PATH (the head's config.json says which kind)
      --speculative-draft-model-path PATH             (also --speculative-draft-model)
      --speculative-draft-model-revision REV          PATH@REV (a Hugging Face Hub id's revision)
    --speculative-algorithm NGRAM                   --draft sam (suffix-automaton retrieval over prompt
                                                      + output, aerie's model-free drafter)
    --speculative-algorithm NONE                    --draft none
    --speculative-num-steps / -eagle-topk /         --tree-depth / --tree-top-k / --tree-tokens
      -num-draft-tokens                               (services/spec/tree_flags.py)
    --speculative-accept-threshold-single/-acc 1.0  accepted at 1.0 only: aerie's verification is lossless
    --speculative-draft-load-format auto|safetensors|pt    accepted (aerie reads both formats)
    --speculative-attention-mode prefill|decode     accepted; aerie has one tree-attention path for both

    vLLM  --speculative-config '{"method": "eagle" | "eagle3" | "ngram" | "suffix", "model": PATH,
                                 "num_speculative_tokens": N, "draft_tensor_parallel_size": 1}'
          -> --draft PATH (ngram, suffix: --draft sam); N draft levels -> --tree-depth N-1 (aerie grows a
             tree of that depth where vLLM drafts a chain)

Refused with a message naming the flag (exit code 2): NEXTN/MTP and STANDALONE (not implemented),
acceptance thresholds other than 1.0 (they make output lossy), --speculative-token-map (aerie's
equivalent is --draft-vocab K over the head's token counts), MoE/attention backends other than auto,
draft-model quantization (use --draft-dtype), and any --speculative-config key not listed above.
SGLang's NGRAM tuning flags are accepted and have no effect (a note on stderr): the suffix automaton
matches the longest suffix at any length, it has no windows or breadths to tune.
"""

from __future__ import annotations

import argparse
import json
import sys

from services.errors import InvalidRequest

ALGORITHMS = ("EAGLE", "EAGLE3", "NGRAM", "NONE", "NEXTN", "STANDALONE")
NOT_IMPLEMENTED = {
    "NEXTN": "NEXTN (a model's own multi-token-prediction layers) is not implemented; aerie drafts with EAGLE heads "
             "(--speculative-algorithm EAGLE/EAGLE3) or retrieval (NGRAM)",
    "STANDALONE": "STANDALONE (a small draft LLM) is not implemented; aerie drafts with EAGLE heads "
                  "(--speculative-algorithm EAGLE/EAGLE3) or retrieval (NGRAM)",
}
NGRAM_TUNING = ("--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size",
                "--speculative-ngram-min-bfs-breadth", "--speculative-ngram-max-bfs-breadth",
                "--speculative-ngram-match-type", "--speculative-ngram-branch-length",
                "--speculative-ngram-capacity")
AUTO_ONLY = ("--speculative-draft-attention-backend", "--speculative-moe-runner-backend",
             "--speculative-moe-a2a-backend")
VLLM_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "revision",
             "prompt_lookup_max", "prompt_lookup_min"}
VLLM_METHODS = {"eagle": "EAGLE", "eagle3": "EAGLE3", "ngram": "NGRAM", "suffix": "NGRAM"}


def _algorithm(text: str) -> str:
    value = text.strip().upper()
    if value not in ALGORITHMS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(ALGORITHMS)}; got {text!r}")
    return value


def _one_threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if value != 1.0:
        raise argparse.ArgumentTypeError(
            f"must be 1.0: aerie verifies losslessly (a threshold below 1 accepts tokens the target would not "
            f"produce); got {text}")
    return value


def add_spec_flags(g) -> None:
    """SGLang's speculative flags (the tree ones are services/spec/tree_flags.py) and vLLM's
    --speculative-config, on an argparse parser or group. `apply_spec_flags` folds them into --draft."""
    sup = argparse.SUPPRESS
    g.add_argument("--speculative-algorithm", "--speculative-algo", dest="spec_algorithm", type=_algorithm,
                   default=None, metavar="ALGO",
                   help="SGLang's: EAGLE or EAGLE3 (a head: --speculative-draft-model-path), NGRAM (= --draft sam), "
                        "NONE (= --draft none); NEXTN and STANDALONE are refused (default: --draft's)")
    g.add_argument("--speculative-draft-model-path", "--speculative-draft-model", dest="spec_draft_path",
                   default=None, metavar="PATH",
                   help="SGLang's name for --draft: an EAGLE head directory or Hugging Face Hub id (default: --draft's)")
    g.add_argument("--speculative-draft-model-revision", dest="spec_draft_revision", default=None, metavar="REV",
                   help="the Hub revision of --speculative-draft-model-path (default: main)")
    g.add_argument("--speculative-draft-load-format", dest="spec_load_format", default=sup,
                   choices=("auto", "safetensors", "pt"),
                   help="SGLang's; aerie reads safetensors and .bin heads alike (default: auto)")
    g.add_argument("--speculative-accept-threshold-single", dest="spec_threshold_single", type=_one_threshold,
                   default=sup, help="SGLang's; 1.0 only: aerie's verification is lossless (default: 1.0)")
    g.add_argument("--speculative-accept-threshold-acc", dest="spec_threshold_acc", type=_one_threshold,
                   default=sup, help="SGLang's; 1.0 only: aerie's verification is lossless (default: 1.0)")
    g.add_argument("--speculative-token-map", dest="spec_token_map", default=None, metavar="FILE",
                   help="SGLang's FR-Spec token map: refused; aerie's equivalent is --draft-vocab K (the K most "
                        "frequent tokens of the head's token_counts.safetensors) (default: none)")
    g.add_argument("--speculative-attention-mode", dest="spec_attention_mode", choices=("prefill", "decode"),
                   default=sup, help="SGLang's; aerie runs one tree-attention path for both (default: prefill)")
    g.add_argument("--speculative-draft-model-quantization", dest="spec_draft_quantization", default=None,
                   metavar="Q", help="SGLang's: refused; aerie's draft precision is --draft-dtype fp32|bf16|int8 (default: none)")
    for flag in AUTO_ONLY:
        g.add_argument(flag, dest=flag[2:].replace("-", "_"), default=None, metavar="BACKEND",
                       help="SGLang's; only auto (aerie has one backend; default: auto)")
    for flag in NGRAM_TUNING:
        g.add_argument(flag, dest=flag[2:].replace("-", "_"), default=None, metavar="N", help=sup)
    g.add_argument("--speculative-config", dest="spec_config", default=None, metavar="JSON",
                   help="vLLM's: {\"method\": \"eagle\"|\"eagle3\"|\"ngram\"|\"suffix\", \"model\": PATH, "
                        "\"num_speculative_tokens\": N} -> --draft PATH and --tree-depth N-1 (docs/cli.md) (default: none)")


def _from_vllm_config(text: str) -> tuple[str, str | None, int | None]:
    """vLLM's --speculative-config JSON -> (algorithm, draft path or None, draft levels or None)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"--speculative-config must be a JSON object; got {text!r} ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise InvalidRequest(f"--speculative-config must be a JSON object; got {text!r}")
    unknown = sorted(set(cfg) - VLLM_KEYS)
    if unknown:
        raise InvalidRequest(f"--speculative-config keys {unknown} are not supported; aerie reads "
                             f"{sorted(VLLM_KEYS)}")
    method = str(cfg.get("method", "eagle" if cfg.get("model") else "")).lower()
    if method not in VLLM_METHODS:
        raise InvalidRequest(f"--speculative-config method must be one of {sorted(VLLM_METHODS)}; got {method!r}")
    if cfg.get("draft_tensor_parallel_size", 1) != 1:
        raise InvalidRequest("--speculative-config draft_tensor_parallel_size must be 1: an EAGLE head runs on one "
                             f"device; got {cfg['draft_tensor_parallel_size']!r}")
    if "prompt_lookup_max" in cfg or "prompt_lookup_min" in cfg:
        print("aerie: note: prompt_lookup_max/min have no effect: the suffix automaton matches the longest "
              "suffix at any length", file=sys.stderr)
    path = cfg.get("model")
    if path is not None and cfg.get("revision"):
        path = f"{path}@{cfg['revision']}"
    n = cfg.get("num_speculative_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 2):
        raise InvalidRequest(f"--speculative-config num_speculative_tokens must be an integer >= 2 (aerie's "
                             f"--tree-depth >= 1); got {n!r}")
    return VLLM_METHODS[method], path, n


def apply_spec_flags(args: argparse.Namespace) -> None:
    """Fold the SGLang/vLLM speculative flags into args.draft (and args.tree_depth for vLLM's
    num_speculative_tokens). Raises InvalidRequest naming a refused flag or value.
    WARNING: mutates `args`."""
    if args.spec_token_map is not None:
        raise InvalidRequest("--speculative-token-map is not supported: aerie's frequency-ranked draft vocabulary "
                             "is --draft-vocab K (the K most frequent tokens of the head's token_counts.safetensors)")
    if args.spec_draft_quantization is not None:
        raise InvalidRequest("--speculative-draft-model-quantization is not supported: the draft head's precision "
                             "is --draft-dtype fp32|bf16|int8")
    for flag in AUTO_ONLY:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value != "auto":
            raise InvalidRequest(f"{flag} must be auto (aerie has one backend); got {value!r}")
    given = [f for f in NGRAM_TUNING if getattr(args, f[2:].replace("-", "_")) is not None]
    if given:
        print(f"aerie: note: {', '.join(given)} have no effect: the suffix automaton matches the longest suffix "
              f"at any length", file=sys.stderr)
    algorithm, path = args.spec_algorithm, args.spec_draft_path
    if args.spec_config is not None:
        if algorithm is not None or path is not None:
            raise InvalidRequest("give vLLM's --speculative-config or SGLang's --speculative-algorithm/"
                                 "--speculative-draft-model-path, not both")
        algorithm, path, levels = _from_vllm_config(args.spec_config)
        if levels is not None:
            args.tree_depth = levels - 1  # levels drafted -> expansion steps after the first (tree_flags.py)
    if path is not None and args.spec_draft_revision:
        path = f"{path}@{args.spec_draft_revision}"
    if algorithm is None and path is None:
        return
    if args.draft is not None:
        raise InvalidRequest(f"give --draft {args.draft} or the --speculative-* flags, not both")
    algorithm = algorithm or "EAGLE"  # a draft path alone: an EAGLE head
    if algorithm in NOT_IMPLEMENTED:
        raise InvalidRequest(f"--speculative-algorithm {algorithm}: {NOT_IMPLEMENTED[algorithm]}")
    if algorithm in ("NGRAM", "NONE"):
        if path is not None:
            raise InvalidRequest(f"--speculative-algorithm {algorithm} takes no draft model; got {path}")
        args.draft = "sam" if algorithm == "NGRAM" else "none"
        return
    if path is None and args.target is not None:
        raise InvalidRequest(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path (aerie ships a "
                             f"head for its default model only)")
    args.draft = path or "eagle"
