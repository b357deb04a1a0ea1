"""Build the drafter: load the head over its target's embedding and lm_head (as `aerie generate` loads
it, without the rest of the target) and serve it.

    servicer = load_servicer(config)
    server, port = await create_server("127.0.0.1:0", config, servicer)
"""

from __future__ import annotations

import grpc

from services.engine.drafter import Drafter
from services.device import default_dtype, resolve_device
from services.engine.local import build_local_head, resolve_draft
from services.model.loading import LoadedTarget
from services.model.runner import warm_up_at_start
from services.errors import CheckpointError
from services.rpc import server as rpc_server
from services.rpc.stubs import drafter_grpc
from services.engine.calibration import load_report
from services.spec.budget import AUTO_LARGEST
from drafter_svc.config import DrafterConfig
from drafter_svc.servicer import DrafterServicer

SERVICE_NAME = "aerie.v1.Drafter"


def load_servicer(config: DrafterConfig, loaded: LoadedTarget | None = None) -> DrafterServicer:
    """Load the head against its target as the in-process engine does, over only the target's
    embedding and lm_head (build_local_head: the rest of the target is never read); `loaded`: the
    target this process holds already (a verifier that drafts too), whose tensors the head uses."""
    if resolve_draft(config.draft, config.target) is None:
        raise CheckpointError("the drafter needs an EAGLE head: pass --draft DIR (AERIE_DRAFT)")
    device = resolve_device(config.device)
    local = build_local_head(config.target, config.draft, config.dtype or default_dtype(device), config.draft_vocab,
                             config.draft_dtype, device=device, loaded=loaded)
    drafter = Drafter(local.head, config.tree or AUTO_LARGEST, config.max_sequences, config.ahead_branches)
    warm_up_at_start(drafter, config.max_sequences)  # CUDA: the draft graphs before the first request
    report = load_report(local.draft_path) or {}
    top1 = float(report.get("top1_agreement") or 0.0) if isinstance(report.get("top1_agreement"), (int, float)) else 0.0
    # the head's t_draft curves for the coordinator's budget (measured as build_local_engine measures them, cached)
    return DrafterServicer(drafter, config, local.draft_path, local.max_context, local.costs, top1)


async def create_server(address: str, config: DrafterConfig, servicer: DrafterServicer | None = None
                        ) -> tuple[grpc.aio.Server, int]:
    servicer = servicer or load_servicer(config)

    def add(server: grpc.aio.Server) -> list[str]:
        register(server, servicer)
        return [SERVICE_NAME]

    return await rpc_server.create_server(address, config.service, "drafter", add)


def register(server: grpc.aio.Server, servicer: DrafterServicer) -> None:
    """The Drafter service on `server` (its own, or a verifier's that drafts too: verifier_svc/server.py)."""
    drafter_grpc.add_DrafterServicer_to_server(servicer, server)
