"""Build the drafter: load target + head (as `aerie generate` does) and serve them.

    servicer = load_servicer(config)
    server, port = await create_server("127.0.0.1:0", config, servicer)
"""

from __future__ import annotations

import grpc

from services.engine.drafter import Drafter
from services.engine.local import build_local_engine, resolve_draft
from services.errors import CheckpointError
from services.rpc import server as rpc_server
from services.rpc.stubs import drafter_grpc
from drafter_svc.config import DrafterConfig
from drafter_svc.servicer import DrafterServicer

SERVICE_NAME = "aerie.v1.Drafter"


def load_servicer(config: DrafterConfig) -> DrafterServicer:
    """Load the head against its target exactly as the in-process engine does.
    NOTE: the whole target is loaded although the head only reads its embedding and lm_head; loading
    just those two tensors would save memory on large targets."""
    if resolve_draft(config.draft, config.target) is None:
        raise CheckpointError("the drafter needs an EAGLE head: pass --draft DIR (AERIE_DRAFT)")
    local = build_local_engine(config.target, config.draft, config.dtype, config.tree,
                               config.draft_vocab, config.draft_dtype)
    assert local.engine.drafter is not None
    drafter = Drafter(local.engine.drafter.head, config.tree, config.max_sequences)
    return DrafterServicer(drafter, config, local.draft_path or "", local.engine.max_context)


async def create_server(address: str, config: DrafterConfig, servicer: DrafterServicer | None = None
                        ) -> tuple[grpc.aio.Server, int]:
    servicer = servicer or load_servicer(config)

    def register(server: grpc.aio.Server) -> list[str]:
        drafter_grpc.add_DrafterServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    return await rpc_server.create_server(address, config.service, "drafter", register)
