"""A tensor-parallel process group with a deadline on every collective.

    comm = init_group(rank, world, "tcp://127.0.0.1:29500", device="cpu", timeout_s=30)
    comm.all_reduce(t); comm.gather_rows(part, sizes); comm.broadcast_object(obj)

The backend follows the device: gloo on the CPU, NCCL on CUDA (`backend_for`). Every collective is
started asynchronously and waited for at most `timeout_s` (`Work.wait(timeout)`): a dead or stuck
rank turns into a `GroupError` on the others within the deadline, never a hang. Joining has its own,
longer deadline (`startup_timeout_s`): ranks load their shards before they join, at different speeds.
"""

from __future__ import annotations

import datetime
import pickle
import socket

import torch
import torch.distributed as dist

from services.errors import GroupError  # noqa: F401  (re-exported: services.dist.group.GroupError)


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def free_address(host: str = "127.0.0.1") -> str:
    """tcp://host:port with a port free right now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class GroupComm:
    """The collectives of one rank (services/model/tp.py `Comm`, plus object broadcast for the proxy).
    Built before the group exists (the model's modules hold it while the shard loads); `join`
    then enters the group. Every collective waits at most `timeout_s`."""

    def __init__(self, rank: int, world: int, device: str, timeout_s: float) -> None:
        self.rank, self.world, self.device, self.timeout_s = rank, world, device, timeout_s
        self._deadline = datetime.timedelta(seconds=timeout_s)
        self._nccl = backend_for(device) == "nccl"

    def join(self, address: str, startup_timeout_s: float = 600.0) -> "GroupComm":
        """Enter the group at `address` (tcp://host:port); waits up to `startup_timeout_s` for every
        rank (they may still be loading their shards)."""
        backend = backend_for(self.device)
        if self._nccl:
            torch.cuda.set_device(torch.device(self.device))
        try:
            dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world,
                                    timeout=datetime.timedelta(seconds=max(startup_timeout_s, self.timeout_s)))
        except Exception as e:
            raise GroupError(f"rank {self.rank} of {self.world} could not join the group at {address} within "
                             f"{startup_timeout_s:g} s: {type(e).__name__}: {str(e)[:300]}") from e
        return self

    def _wait(self, what: str, start) -> None:
        """Run one async collective and wait for it at most the deadline."""
        try:
            work = start()
            if not work.wait(self._deadline):
                raise TimeoutError(f"not done after {self.timeout_s:g} s")
        except GroupError:
            raise
        except Exception as e:  # gloo/NCCL raise RuntimeError (and subclasses) on timeouts and lost peers
            raise GroupError(f"tensor-parallel {what} failed on rank {self.rank} of {self.world} "
                             f"(deadline {self.timeout_s:g} s): {type(e).__name__}: {str(e)[:300]}") from e

    def all_reduce(self, t: torch.Tensor) -> None:
        self._wait("all-reduce", lambda: dist.all_reduce(t, async_op=True))

    def gather_rows(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """t [T, sizes[rank]] on every rank -> [T, sum(sizes)] on rank 0 (None elsewhere)."""
        width = max(sizes)
        if t.shape[1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[1]))
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        self._wait("gather", lambda: dist.gather(t, parts, dst=0, async_op=True))
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: its tensors should be on the CPU)."""
        device = torch.device(self.device) if self._nccl else torch.device("cpu")
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.long, device=device)
        else:
            size = torch.zeros(1, dtype=torch.long, device=device)
        self._wait("broadcast", lambda: dist.broadcast(size, 0, async_op=True))
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self._wait("broadcast", lambda: dist.broadcast(buf, 0, async_op=True))
        return obj if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())

    def barrier(self) -> None:
        self.broadcast_object(None)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group with a dead peer may refuse a clean shutdown
                pass


def init_group(rank: int, world: int, address: str, device: str = "cpu", timeout_s: float = 30.0,
               startup_timeout_s: float = 600.0) -> GroupComm:
    """Join the group at `address` (tcp://host:port) as `rank` of `world`."""
    return GroupComm(rank, world, device, timeout_s).join(address, startup_timeout_s)
