"""A worker rank of a local tensor-parallel group: `python -m services.dist.worker --rank R
--address tcp://HOST:PORT --spec JSON` (started by services/dist/launch.py `LocalExecutor`). It joins
the group, loads its shard and runs rank 0's calls until told to stop or the group fails."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.dist.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--spec", required=True, help="GroupSpec as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    threads = os.environ.get("AERIE_TORCH_THREADS")  # as the rank-0 process (aerie_cli/flags.py)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    from services.dist.launch import GroupSpec, load_rank
    from services.dist.proxy import serve_worker

    runner, comm, _ = load_rank(GroupSpec.from_json(args.spec), args.rank, args.address)
    code = serve_worker(runner, comm)
    logging.shutdown()
    # no destroy_process_group: rank 0 may already be gone, and gloo aborts tearing down a group
    # whose peer left; the process exit releases everything
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
