"""Build the verifier: load the target (as `aerie generate` does) and serve it; with --draft, a head
over the same target too (drafter_svc, on the same port: one process for both roles).

    servicer = load_servicer(config)
    server, port = await create_server("127.0.0.1:0", config, servicer)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from services.device import check_device, default_dtype, resolve_device
from services.engine.local import build_local_engine
from services.engine.calibration import target_costs
from services.model.loading import LoadedTarget
from services.rpc import server as rpc_server
from services.rpc.stubs import verifier_grpc
from verifier_svc.config import VerifierConfig
from verifier_svc.servicer import VerifierServicer, context_limit

SERVICE_NAME = "aerie.v1.Verifier"
log = logging.getLogger("aerie.verifier")


def load_servicer(config: VerifierConfig) -> VerifierServicer:
    """Load the target exactly as the in-process engine does (same loader, dtype and EOS ids)."""
    if config.tp > 1 and config.executor == "ray":  # the ranks' GPUs are Ray's bundles, not this process's
        device = check_device(config.device or "cpu")
    else:
        device = resolve_device(config.device)
    dtype = config.dtype or default_dtype(device)
    if config.tp > 1:
        return load_group_servicer(config, device, dtype)
    local = build_local_engine(config.target, "none", dtype, device=device)
    engine = local.engine
    target = engine.verifier.target
    context_limit(target.config.max_context, config.max_model_len)  # a bad --max-model-len: before calibrating
    # t_verify for the coordinator's budget: measured once per device/model/dtype/threads, cached
    costs = target_costs(target, f"{local.model_dir}|{dtype}")
    drafter = None
    if config.drafter is not None:  # --draft: a head served here too, over this target's embedding and lm_head
        from drafter_svc.server import load_servicer as load_drafter

        drafter = load_drafter(replace(config.drafter, device=config.drafter.device or device, dtype=dtype),
                               LoadedTarget(target, local.tokenizer, local.model_dir))
    return VerifierServicer(target, config, local.target_path, engine.eos_token_ids, costs, drafter=drafter)


def load_group_servicer(config: VerifierConfig, device: str, dtype: str) -> VerifierServicer:
    """A tensor-parallel group of `config.tp` ranks (services/dist): this process is rank 0 and
    serves; the executor starts the other ranks. The Verifier above it is the same as at TP=1."""
    from services.dist.launch import GroupSpec, make_executor
    from services.dist.proxy import group_costs
    from services.model.loading import find_default_gguf

    target_path = config.target or find_default_gguf()
    spec = GroupSpec(config.tp, target_path, dtype, "cuda" if device.startswith("cuda") else device,
                     timeout_s=config.tp_timeout_s)
    executor = make_executor(config.executor)
    proxy = executor.start(spec)
    try:
        target = proxy.target
        eos = target.config.eos_token_ids
        if executor.eos_token_id is not None:  # the tokenizer's EOS, as build_local_engine adds it
            eos = tuple(sorted(set(eos) | {int(executor.eos_token_id)}))
        costs = group_costs(proxy, f"{executor.model_dir}|{dtype}")  # through the group: broadcasts included
    except BaseException:
        proxy.close()
        raise
    return VerifierServicer(target, config, target_path, eos, costs, runner=proxy)


async def watch_group(servicer: VerifierServicer, health_servicer, period_s: float = 0.2) -> None:
    """Health NOT_SERVING as soon as the tensor-parallel group is down (the proxy's heartbeat finds a
    dead rank within the collective deadline even when no call is in flight)."""
    from grpc_health.v1 import health_pb2

    while servicer.group.alive:
        await asyncio.sleep(period_s)
    if servicer.group.error is not None:  # else: closed on shutdown
        log.error("tensor-parallel group down: health NOT_SERVING (%s)", servicer.group.error)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def create_server(address: str, config: VerifierConfig, servicer: VerifierServicer | None = None
                        ) -> tuple[grpc.aio.Server, int]:
    servicer = servicer or load_servicer(config)

    def register(server: grpc.aio.Server) -> list[str]:
        verifier_grpc.add_VerifierServicer_to_server(servicer, server)
        if servicer.drafter_servicer is None:
            return [SERVICE_NAME]
        from drafter_svc.server import SERVICE_NAME as DRAFTER, register as register_drafter

        register_drafter(server, servicer.drafter_servicer)  # (the same port: a drafter at this verifier's address)
        return [SERVICE_NAME, DRAFTER]

    server, port = await rpc_server.create_server(address, config.service, "verifier", register)
    if servicer.group is not None:
        servicer.watcher = asyncio.ensure_future(watch_group(servicer, rpc_server.health_of(server)))
    return server, port
