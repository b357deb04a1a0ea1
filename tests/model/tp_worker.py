"""One rank of a tensor-parallel test group (run as `python -m tests.model.tp_worker`): load this
rank's shard, prefill a prompt, decode greedily (rank 0 picks each token and broadcasts it), then
verify a tree; rank 0 writes the tokens and the tree's logits/hidden/taps to OUT (torch.save)."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layout", default="both:2")
    a = p.parse_args()
    torch.set_num_threads(1)
    from services.dist.group import init_group
    from services.model.loading import TPShard, load_target

    comm = init_group(a.rank, a.world, a.address, "cpu", timeout_s=60)
    model = load_target(a.model, torch.float32, "cpu", a.layout, tp=TPShard(a.rank, a.world, comm)).model
    result = run(model, [int(x) for x in a.prompt.split(",")], a.steps, comm)
    if a.rank == 0:
        torch.save(result, a.out)
    comm.barrier()
    # as services/dist/worker.py: no destroy_process_group at exit (tearing a gloo group down while
    # a peer leaves can abort with "terminate called without an active exception")
    sys.stdout.flush()
    os._exit(0)


@torch.no_grad()
def run(model, prompt: list[int], steps: int, comm=None) -> dict:
    """The same work at TP=1 (comm None) and on every rank of a group."""
    cache = model.new_cache(len(prompt) + steps + 8)
    out = model(torch.tensor(prompt), cache, logits_for="last")
    tokens = []
    for _ in range(steps):
        tok = int(out.logits[-1].argmax()) if out.logits.shape[-1] else None
        if comm is not None:
            tok = comm.broadcast_object(tok)
        tokens.append(tok)
        out = model(torch.tensor([tok]), cache, logits_for="last")
    # a verification tree: root -> (a -> c, b)
    prefix = cache.length
    ids = torch.tensor([tokens[-1], 3, 5, 7])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree = model(ids, cache, positions=prefix + torch.tensor([0, 1, 1, 2]), tree_mask=mask, want_taps=True)
    return {"tokens": tokens, "logits": tree.logits, "hidden": tree.hidden, "taps": tree.taps,
            "kv_heads": cache.k.shape[1]}


if __name__ == "__main__":
    main()
