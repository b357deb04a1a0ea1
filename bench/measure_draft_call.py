"""What one Draft call costs through gRPC against the same draft in process: where a direct run's
miss (the verifier's Draft after the verdict, 6-7 ms on the tiny16 head) spends its time
(docs/benchmarks.md, "The tree in flight's rows").

A drafter process (`aerie drafter`, the tests' tiny 16-layer target and distilled head, the fixed
16/3/4 tree, its default draft dtype) on loopback, nothing else running; a synchronous client calls,
one after another: GetInfo (a gRPC round trip answered on the event loop), Release of an unknown
sequence (the round trip plus the hand-off to the model thread and back: the batcher), and Draft with
`--rows` new rows (all of that plus the draft); then the same drafts in this process (a Drafter over
the same checkpoint and dtype). Milliseconds, median after `--warm` calls.

    AERIE_TORCH_THREADS=1 .venv/bin/python bench/measure_draft_call.py --calls 300 --json-out /tmp/draft-call.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from report import emit  # (bench/)


def timed(fn, n: int, warm: int) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(xs[warm:]), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="calls of each kind")
    ap.add_argument("--warm", type=int, default=20, help="first calls left out of the median")
    ap.add_argument("--rows", type=int, default=1, help="new rows a Draft carries")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("AERIE_TORCH_THREADS", "1")))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import grpc

    from services.device import default_draft_dtype
    from services.engine.local import build_local_head
    from services.rpc import codec
    from services.rpc.stubs import common as pb
    from services.rpc.stubs import drafter as dpb
    from services.rpc.stubs import drafter_grpc
    from services.spec.tree import TreeParams
    from tests.helpers import distill_head, save_bench_dirs, tiny_hf, to_native

    tree = TreeParams(4, 3, 16)
    prompt = 40
    rows_needed = prompt + args.rows * (args.calls + 1) + 64
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    hf = tiny_hf("llama", layers=16, seed=0)
    save_bench_dirs((hf, to_native(hf), distill_head(to_native(hf), "eagle", seed=0)), root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AERIE_TORCH_THREADS": os.environ.get("AERIE_TORCH_THREADS", "1"), "AERIE_LOG_LEVEL": "WARNING"}
    drafter = subprocess.Popen([sys.executable, "-m", "aerie_cli", "drafter", "--draft", str(root / "head"),
                                "--target", str(root / "target"), "--dtype", "fp32", "--tree-top-k", "4",
                                "--tree-depth", "3", "--tree-tokens", "16", "--host", "127.0.0.1", "--port", str(port)],
                               env=env)
    report: dict = {}
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=300)
        stub = drafter_grpc.DrafterStub(channel)
        info = stub.GetInfo(pb.InfoRequest(), timeout=30)
        width = int(info.feature_size)
        g = torch.Generator().manual_seed(0)
        first = dpb.DrafterPrefillRequest(sequence_id="a", max_rows=min(rows_needed, 1000),
                                          tokens=list(range(3, 3 + prompt)),
                                          features=codec.encode_tensor(torch.randn(prompt, width, generator=g)))
        stub.Prefill(iter([first]), timeout=60)
        calls = min(args.calls, (1000 - prompt - 64) // args.rows)
        index = [1]

        def draft_call():
            index[0] += 1
            stub.Draft(dpb.DraftRequest(sequence_id="a", round_index=index[0], tokens=[5] * args.rows,
                                        features=codec.encode_tensor(torch.randn(args.rows, width, generator=g))),
                       timeout=30)

        report["get_info_ms"] = timed(lambda: stub.GetInfo(pb.InfoRequest(), timeout=30), args.calls, args.warm)
        report["release_unknown_ms"] = timed(lambda: stub.Release(pb.ReleaseRequest(sequence_id="none"), timeout=30),
                                             args.calls, args.warm)
        report["draft_call_ms"] = timed(draft_call, calls, args.warm)
        channel.close()
    finally:
        drafter.terminate()
        drafter.wait()
    from services.engine.drafter import Drafter

    head = build_local_head(str(root / "target"), str(root / "head")).head  # (as the drafter service loads it)
    local = Drafter(head, tree)
    local.start("a", 1000, sampling=False)
    local.draft("a", torch.arange(3, 3 + prompt), torch.randn(prompt, head.config.feature_size, generator=g), tree)
    report["draft_in_process_ms"] = timed(
        lambda: local.draft("a", torch.tensor([5] * args.rows), torch.randn(args.rows, head.config.feature_size), tree),
        calls, args.warm)
    report["config"] = {"rows": args.rows, "calls": calls, "draft_dtype": default_draft_dtype("cpu"),
                        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()}
    emit(report, args.json_out)


if __name__ == "__main__":
    main()
