"""The split pipeline against the colocated one (`aerie up --colocate`, with its runs of tree rounds
and with `--plain-run 0`: one Verify call a round), the split one with direct drafts (`aerie up
--direct-drafts`, with runs and without) and the in-process engine on one random checkpoint of a
shape, interleaved request by request (machine noise hits them all alike): ms per EAGLE round (a
fixed tree, random weights: one token a round) and each round's wall, draft and verify ms, medians
over the requests.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_colocated.py --shape tiny --requests 8 \
        --tokens 64 --prompt 64 [--out FILE.json]

The tiny shape's rounds take a few ms on the CPU, as a large model's do on a GPU, so the services'
per-round costs (transits, hand-offs, encoding) weigh there as they would on a GPU. With
AERIE_PAGED_KV=1 (and AERIE_KV_BUDGET_MB=256: the paged arena is allocated at start) every side runs
the GPU's code paths eagerly: the in-process engine's rounds on the device (device trees, verdict
drafts) and the colocated verifier's device rounds, against `colocated_host` (AERIE_DEVICE_ROUND=0):
the host work each adds to a round, on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import emit  # noqa: E402  (bench/)


# name -> (aerie up --colocate, more `aerie up` flags, more environment); colocated_host: the colocated
# runs without device rounds (they run where the KV is paged: a GPU, or the CPU with AERIE_PAGED_KV=1)
PIPELINES = {"split": (False, ("--no-direct-drafts",), {}), "colocated": (True, (), {}),
             "colocated_host": (True, (), {"AERIE_DEVICE_ROUND": "0"}),
             "colocated_no_runs": (True, ("--plain-run", "0"), {}),
             "direct": (False, ("--direct-drafts",), {}), "direct_no_runs": (False, ("--direct-drafts", "--plain-run", "0"), {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--pipelines", default="colocated,colocated_no_runs,direct,direct_no_runs",
                   help=f"the pipelines measured besides split and in process, of {', '.join(PIPELINES)}")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from aerie_cli.flags import set_torch_threads
    from services.bench.gpu import hf_config, random_prompt
    from services.bench.pipeline_shape import TREE, AerieUp, PipelineBenchConfig, remote_stream, timed_stream, write_checkpoint
    from services.engine.engine import GenerationRequest
    from services.engine.local import build_local_engine
    from services.spec.tree import TreeParams

    set_torch_threads()
    cfg = PipelineBenchConfig(args.shape, args.device, args.dtype, args.prompt, args.tokens, args.requests)
    request = GenerationRequest(random_prompt(hf_config(args.shape).vocab_size, args.prompt, 0), args.tokens,
                                ignore_eos=True)
    root = Path(tempfile.mkdtemp(prefix="aerie-colocated-"))
    target, head = write_checkpoint(args.shape, args.device, args.dtype, root)
    engine = build_local_engine(str(target), str(head), args.dtype, TreeParams(*TREE), device=args.device).engine
    sides = {"in_process": lambda: engine.generate(request)}
    pipelines = {name: PIPELINES[name] for name in ("split", *args.pipelines.split(","))}
    runs: dict[str, list] = {name: [] for name in ("in_process", *pipelines)}
    with ExitStack() as stack:
        for name, (colocate, extra, env) in pipelines.items():
            address = stack.enter_context(AerieUp(cfg, target, str(head), root / f"{name}.log", colocate, extra, env))
            sides[name] = lambda a=address: remote_stream(a, request)
        for generate in sides.values():
            timed_stream(generate)  # warm-up
        for _ in range(args.requests):
            for name, generate in sides.items():  # interleaved
                runs[name].append(timed_stream(generate))
    report: dict = {"shape": args.shape, "device": args.device, "dtype": args.dtype, "prompt": args.prompt,
                    "tokens": args.tokens, "requests": args.requests, "tree": "%d/%d/%d" % (TREE[2], TREE[1], TREE[0])}
    for name, rs in runs.items():
        parts = [x for r in rs for x in r.parts_ms]
        report[name] = {"ms_per_round": statistics.median(r.seconds * 1e3 / r.decoded for r in rs),
                        "round_wall_ms": statistics.median(x[0] for x in parts),
                        "round_draft_ms": statistics.median(x[1] for x in parts),
                        "round_verify_ms": statistics.median(x[2] for x in parts),
                        "same_tokens": rs[0].tokens == runs["in_process"][0].tokens}
    for name in pipelines:
        report[name]["in_process_ratio"] = report["in_process"]["ms_per_round"] / report[name]["ms_per_round"]
        report[name]["over_split"] = report["split"]["ms_per_round"] / report[name]["ms_per_round"]
    emit(report, args.out)


if __name__ == "__main__":
    main()
