"""Build the verifier: load the target (as `aerie generate` does) and serve it.

    servicer = load_servicer(config)
    server, port = await create_server("127.0.0.1:0", config, servicer)
"""

from __future__ import annotations

import grpc

from services.device import default_dtype, resolve_device
from services.engine.local import build_local_engine
from services.spec.budget import target_costs
from services.rpc import server as rpc_server
from services.rpc.stubs import verifier_grpc
from verifier_svc.config import VerifierConfig
from verifier_svc.servicer import VerifierServicer

SERVICE_NAME = "aerie.v1.Verifier"


def load_servicer(config: VerifierConfig) -> VerifierServicer:
    """Load the target exactly as the in-process engine does (same loader, dtype and EOS ids)."""
    device = resolve_device(config.device)
    dtype = config.dtype or default_dtype(device)
    local = build_local_engine(config.target, "none", dtype, device=device)
    engine = local.engine
    target = engine.verifier.target
    # t_verify for the coordinator's budget: measured once per device/model/dtype/threads, cached
    costs = target_costs(target, f"{local.model_dir}|{dtype}")
    return VerifierServicer(target, config, local.target_path, engine.eos_token_ids, costs)


async def create_server(address: str, config: VerifierConfig, servicer: VerifierServicer | None = None
                        ) -> tuple[grpc.aio.Server, int]:
    servicer = servicer or load_servicer(config)

    def register(server: grpc.aio.Server) -> list[str]:
        verifier_grpc.add_VerifierServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return await rpc_server.create_server(address, config.service, "verifier", register)
