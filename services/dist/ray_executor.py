"""The Ray executor: a tensor-parallel group's ranks as Ray actors in a placement group, so a group
can span the nodes of a Ray cluster (`aerie verifier --tp N --executor ray`).

    proxy = RayExecutor().start(spec)        # the ModelRunner's five methods, forwarded to rank 0
    Verifier(None, "hidden", runner=proxy)   # the rank-0 verifier, unchanged

One bundle per rank ({"CPU": 1}, or {"CPU": 1, "GPU": 1} when the group runs on cuda), strategy PACK
(ranks on as few nodes as fit: all-reduce traffic stays on NVLink/PCIe where it can). Each actor
loads its shard (`load_rank`, the same code as a local rank) and joins the group at rank 0's
actor's address (its node IP and a free port). Rank 0's actor holds the `GroupRunner`: the verifier
process forwards each call to it (`ray.get` with the collective deadline plus a margin: a dead actor
or node is a `GroupError`, never a hang) and the other actors run `serve_worker`. The verifier
process itself holds no weights, only the model's config (`TargetInfo`).

Ray joins the cluster at RAY_ADDRESS when set, else starts a local one (`ray.init()`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from services.errors import AerieError, GroupError
from services.model.config import ModelConfig


@dataclass(frozen=True)
class TargetInfo:
    """What the verifier service reads of the target when the weights live in the group's actors."""
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device


class _RankActor:
    """One rank (decorated as a Ray actor in `RayExecutor.start`)."""

    def __init__(self, spec_json: str, rank: int) -> None:
        from services.dist.launch import GroupSpec

        self.spec = GroupSpec.from_json(spec_json)
        self.rank = rank
        self.proxy = None
        self.comm = None
        self.runner = None

    def address(self) -> str:
        import ray

        from services.dist.group import free_address

        return free_address(ray.util.get_node_ip_address())

    def pid(self) -> int:
        return os.getpid()

    def start(self, address: str) -> dict:
        from services.dist.launch import load_rank
        from services.dist.proxy import GroupRunner

        device = self.spec.rank_device(self.rank)
        if device.startswith("cuda"):
            device = "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to this bundle's GPU
        self.runner, self.comm, loaded = load_rank(self.spec, self.rank, address, device)
        if self.rank == 0:
            self.proxy = GroupRunner(self.runner, self.comm)
            t = loaded.model
            tok = loaded.tokenizer
            return {"info": TargetInfo(t.config, t.dtype, torch.device("cpu")), "model_dir": loaded.path,
                    "eos": getattr(tok, "eos_token_id", None) if tok is not None else None}
        return {}

    def serve(self) -> int:
        """Workers: run rank 0's calls until STOP or a failed collective."""
        from services.dist.proxy import serve_worker

        return serve_worker(self.runner, self.comm)

    def call(self, method: str, args: tuple):
        """Rank 0: one ModelRunner call through the group. Errors come back as values (a Ray task
        error would lose the exception's type)."""
        try:
            return ("ok", self.proxy._call(method, *args))
        except AerieError as e:
            return ("error", e)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()


class RayGroupRunner:
    """The verifier process's side: the ModelRunner's methods, forwarded to rank 0's actor."""

    def __init__(self, executor: "RayExecutor", rank0, info: TargetInfo, world: int, timeout_s: float) -> None:
        self.executor, self.rank0, self.target, self.world = executor, rank0, info, world
        self.timeout_s = timeout_s
        self.error: GroupError | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._watch_workers, daemon=True, name="ray-tp-watch")
        self._watch.start()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # results arrive on the host

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed

    def allocate(self, rows: int) -> int:
        return self._call("allocate", rows)

    def release(self, slot: int) -> None:
        return self._call("release", slot)

    def grow(self, slot: int, rows: int) -> None:
        return self._call("grow", slot, rows)

    def keep(self, slot: int, start: int, rows) -> None:
        return self._call("keep", slot, start, rows)

    def execute(self, step):
        return self._call("execute", step)

    def run_all(self, fn_path: str, *args):
        return self._call("fn", fn_path, *args)

    def _call(self, method: str, *args):
        import ray

        from services.dist.proxy import to_host

        if self._closed:
            raise GroupError("the tensor-parallel group is shut down")
        if self.error is not None:
            raise GroupError(f"the tensor-parallel group of {self.world} ranks is down: {self.error}")
        with self._lock:
            try:
                status, value = ray.get(self.rank0.call.remote(method, to_host(args)),
                                        timeout=self.timeout_s * 3 + 60)  # a forward's collectives + margin
            except Exception as e:  # GetTimeoutError, RayActorError (actor or node gone), ...
                self._fail(GroupError(f"rank 0's actor failed or missed its deadline: {type(e).__name__}: "
                                      f"{str(e)[:300]}"))
                raise self.error from e
        if status == "error":
            if isinstance(value, GroupError):
                self._fail(value)
            raise value
        return value

    def _fail(self, e: GroupError) -> None:
        if self.error is None:
            self.error = e

    def _watch_workers(self) -> None:
        """A worker actor's `serve` returns only when the group stops or fails: mark the group down
        (rank 0's heartbeat finds a dead worker as well; this also covers a dead rank-0 actor)."""
        import ray

        pending = list(self.executor.serving)
        while pending and not self._closed:
            done, pending = ray.wait(pending, timeout=0.5)
            if done and not self._closed:
                try:
                    code = ray.get(done[0])
                    reason = f"a worker rank left the group (exit {code})"
                except Exception as e:
                    reason = f"a worker rank's actor died: {type(e).__name__}: {str(e)[:200]}"
                self._fail(GroupError(reason))
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.executor.stop()


class RayExecutor:
    def __init__(self) -> None:
        self.actors: list = []
        self.serving: list = []
        self.pg = None

    def start(self, spec):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise AerieError("--executor ray needs Ray: pip install 'aerie[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                     log_to_driver=False)
        gpu = spec.device.startswith("cuda")
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(spec.world)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=spec.startup_timeout_s)
        except Exception as e:
            self.stop()
            raise GroupError(f"Ray could not place {spec.world} bundles of {bundle} within "
                             f"{spec.startup_timeout_s:g} s: {type(e).__name__}: {str(e)[:200]}") from e
        actor_cls = ray.remote(max_concurrency=2)(_RankActor)
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}}
        for rank in range(spec.world):
            self.actors.append(actor_cls.options(
                num_cpus=1, num_gpus=1 if gpu else 0, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(spec.to_json(), rank))
        try:
            address = ray.get(self.actors[0].address.remote(), timeout=spec.startup_timeout_s)
            started = ray.get([a.start.remote(address) for a in self.actors], timeout=spec.startup_timeout_s)
        except Exception as e:
            self.stop()
            raise GroupError(f"the Ray group of {spec.world} ranks did not start: {type(e).__name__}: "
                             f"{str(e)[:400]}") from e
        self.serving = [a.serve.remote() for a in self.actors[1:]]
        info = started[0]
        self.model_dir = info["model_dir"]
        self.eos_token_id = info["eos"]
        return RayGroupRunner(self, self.actors[0], info["info"], spec.world, spec.timeout_s)

    @property
    def pids(self) -> list[int]:
        import ray

        return ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def stop(self) -> None:
        import ray

        if self.actors:
            try:
                ray.get(self.actors[0].close.remote(), timeout=10)
            except Exception:
                pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
