"""Start a tensor-parallel group: what every rank loads, and the local-process executor.

    spec = GroupSpec(world=2, target="/models/x", dtype="fp32", device="cpu")
    proxy = LocalExecutor().start(spec)      # ranks 1..N-1 as local processes, rank 0 here
    Verifier(None, "hidden", runner=proxy)   # the rank-0 verifier, unchanged

Each rank joins the group (services/dist/group.py), loads only its shard (services/model/loading.py
with `TPShard`) on its device and builds a ModelRunner. On GPUs rank r of a local group uses
`cuda:r`. `python -m services.dist.worker` is a worker rank's process (services/dist/worker.py);
the Ray executor (services/dist/ray_executor.py) runs the same `load_rank` inside actors.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from services.device import check_dtype
from services.errors import InvalidRequest

log = logging.getLogger("aerie.dist")
EXECUTORS = ("local", "ray")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    world: int  # ranks (GPUs) in the group
    target: str  # HF directory or .gguf (resolved: never None here)
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (CUDA only: services.device.check_dtype)
    device: str = "cpu"  # cpu | cuda (rank r of a local group: cuda:r)
    layout: str | None = None  # linear weight layout (loading.default_layout() when None)
    timeout_s: float = 30.0  # deadline of every collective
    startup_timeout_s: float = 600.0  # deadline of joining the group (every rank loads its shard first)
    host: str = "127.0.0.1"  # rendezvous host (rank 0's address as the other ranks reach it)

    def __post_init__(self) -> None:
        if self.world < 1:
            raise InvalidRequest(f"--tp must be >= 1; got {self.world}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise InvalidRequest(f"tensor parallelism runs fp32, bf16 or fp16 weights; got --dtype {self.dtype}")
        check_dtype(self.dtype, self.device)
        if self.device.startswith("cuda:") and self.world > 1:
            raise InvalidRequest(f"--device {self.device} names one GPU; a group of {self.world} ranks uses "
                                 f"--device cuda (rank r on cuda:r, or one GPU per Ray bundle)")
        if self.timeout_s <= 0:
            raise InvalidRequest(f"the group's collective deadline must be > 0 s; got {self.timeout_s}")

    def rank_device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device == "cuda" else self.device

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "GroupSpec":
        return GroupSpec(**json.loads(text))


def load_rank(spec: GroupSpec, rank: int, address: str, device: str | None = None):
    """Join the group at `address` as `rank` and load this rank's shard: (ModelRunner, comm)."""
    from services.dist.group import GroupComm
    from services.engine.local import DTYPES
    from services.model.loading import TPShard, load_target
    from services.model.runner import ModelRunner

    device = device or spec.rank_device(rank)
    comm = GroupComm(rank, spec.world, device, spec.timeout_s)
    # load first (no collective needed), then join: the join waits for the slowest rank's load
    loaded = load_target(spec.target, DTYPES[spec.dtype], device, spec.layout, tp=TPShard(rank, spec.world, comm))
    comm.join(address, spec.startup_timeout_s)
    return ModelRunner(loaded.model), comm, loaded


class LocalExecutor:
    """Ranks 1..N-1 as child processes of this one (`python -m services.dist.worker`); rank 0 here."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, spec: GroupSpec):
        from services.dist.group import GroupError, free_address
        from services.dist.proxy import GroupRunner

        address = free_address(spec.host)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for rank in range(1, spec.world):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.dist.worker", "--rank", str(rank), "--address", address,
                 "--spec", spec.to_json()], env=env))
        try:
            runner, comm, loaded = load_rank(spec, 0, address)
        except BaseException as e:
            self.stop()
            if isinstance(e, GroupError):
                dead = [p.args[4] for p in self.procs if p.poll() is not None]
                raise GroupError(f"{e} (worker ranks exited: {dead or 'none'})") from e
            raise
        self.model_dir = loaded.path
        tok = loaded.tokenizer
        self.eos_token_id = getattr(tok, "eos_token_id", None) if tok is not None else None
        return GroupRunner(runner, comm, on_close=self.stop)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, grace_s: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.wait(grace_s)  # STOP was broadcast: they exit on their own
                except subprocess.TimeoutExpired:
                    p.terminate()
        for p in self.procs:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()


def make_executor(name: str):
    if name == "local":
        return LocalExecutor()
    if name == "ray":
        from services.dist.ray_executor import RayExecutor

        return RayExecutor()
    raise InvalidRequest(f"executor must be one of {list(EXECUTORS)}; got {name!r}")
