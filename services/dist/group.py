"""A tensor-parallel process group with a deadline on every collective.

    comm = init_group(rank, world, "tcp://127.0.0.1:29500", device="cpu", timeout_s=30)
    comm.all_reduce(t); comm.gather_rows(part, sizes); comm.broadcast_object(obj)

The backend follows the device: gloo on the CPU, NCCL on CUDA (`backend_for`). `timeout_s` is the
process group's timeout, which torch applies to every collective (gloo natively; for NCCL
TORCH_NCCL_BLOCKING_WAIT=1 makes a late collective raise instead of hanging): a dead or stuck rank
turns into a `GroupError` on the others within the deadline, never a hang.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from services.errors import AerieError


class GroupError(AerieError, RuntimeError):
    """A collective failed or missed its deadline: a rank of the group is gone or stuck."""


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def free_address(host: str = "127.0.0.1") -> str:
    """tcp://host:port with a port free right now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class GroupComm:
    """The collectives of one rank (services/model/tp.py `Comm`, plus object broadcast for the proxy)."""

    def __init__(self, rank: int, world: int, device: str, timeout_s: float) -> None:
        self.rank, self.world, self.device, self.timeout_s = rank, world, device, timeout_s

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GroupError:
            raise
        except Exception as e:  # gloo/NCCL raise RuntimeError (and subclasses) on timeouts and lost peers
            raise GroupError(f"tensor-parallel {what} failed on rank {self.rank} of {self.world} "
                             f"(deadline {self.timeout_s:g} s): {type(e).__name__}: {str(e)[:300]}") from e

    def all_reduce(self, t: torch.Tensor) -> None:
        self._run("all-reduce", dist.all_reduce, t)

    def gather_rows(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """t [T, sizes[rank]] on every rank -> [T, sum(sizes)] on rank 0 (None elsewhere)."""
        width = max(sizes)
        if t.shape[1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        self._run("gather", dist.gather, t, parts, dst=0)
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled; tensors inside should be on the CPU)."""
        box = [obj]
        self._run("broadcast", dist.broadcast_object_list, box, src=0,
                  device=torch.device(self.device) if backend_for(self.device) == "nccl" else None)
        return box[0]

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group with a dead peer may refuse a clean shutdown
                pass


def init_group(rank: int, world: int, address: str, device: str = "cpu", timeout_s: float = 30.0) -> GroupComm:
    """Join the group at `address` (tcp://host:port) as `rank` of `world`."""
    backend = backend_for(device)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")  # a late collective raises: no hang
        torch.cuda.set_device(torch.device(device))
    try:
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise GroupError(f"rank {rank} of {world} could not join the group at {address} within "
                         f"{timeout_s:g} s: {type(e).__name__}: {str(e)[:300]}") from e
    return GroupComm(rank, world, device, timeout_s)
