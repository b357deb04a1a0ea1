"""The service commands of `aerie`: each one process serving one gRPC API.

    aerie verifier ...      serve the target (verifier_svc)
    aerie drafter ...       serve the EAGLE head (drafter_svc)
    aerie coordinator ...   serve the public API (coordinator)

Each command: argparse -> validated config -> serve. Configuration errors exit with code 2.
The flags live in each service's config module (light imports only: they build `--help`).
"""

from __future__ import annotations

import argparse
import asyncio

from aerie_cli.flags import add_command


def register(sub: argparse._SubParsersAction) -> None:
    from coordinator import config as coordinator_config
    from drafter_svc import config as drafter_config
    from verifier_svc import config as verifier_config

    p = add_command(sub, "verifier", "serve the target model (aerie.v1.Verifier)")
    verifier_config.add_flags(p)
    p.set_defaults(func=cmd_verifier)
    p = add_command(sub, "drafter", "serve an EAGLE draft head (aerie.v1.Drafter)")
    drafter_config.add_flags(p)
    p.set_defaults(func=cmd_drafter)
    p = add_command(sub, "coordinator", "serve the public API (aerie.v1.Coordinator)")
    coordinator_config.add_flags(p)
    p.set_defaults(func=cmd_coordinator)


def cmd_verifier(args: argparse.Namespace) -> int:
    import verifier_svc.config
    import verifier_svc.server

    return _serve_model_service(args, "verifier", verifier_svc.config, verifier_svc.server)


def cmd_drafter(args: argparse.Namespace) -> int:
    import drafter_svc.config
    import drafter_svc.server

    return _serve_model_service(args, "drafter", drafter_svc.config, drafter_svc.server)


def _serve_model_service(args: argparse.Namespace, role: str, config_mod, server_mod) -> int:
    """Load the role's models, serve until SIGTERM/Ctrl-C (registered in Redis when given a URL),
    then unregister and close its worker thread."""
    from services.rpc import registry
    from services.rpc.config import configure_logging
    from services.rpc.server import serve_forever

    config = config_mod.from_args(args)
    reg_config = registry.from_args(args)
    configure_logging(config.service.log_level, role)
    servicer = server_mod.load_servicer(config)
    registrations = []

    async def start():
        server, port = await server_mod.create_server(config.service.address, config, servicer)
        if reg_config is not None:
            address = registry.advertised_address(config.service.host, port, reg_config.advertise)
            # a verifier that drafts too (--draft) is a drafter at the same address as well
            served = [(role, servicer)] + ([("drafter", servicer.drafter_servicer)]
                                           if getattr(servicer, "drafter_servicer", None) is not None else [])
            for name, s in served:
                reg = registry.Registration(registry.connect(reg_config.redis_url), name, address,
                                            lambda s=s: describe_replica(s), reg_config.heartbeat_s, reg_config.ttl_s)
                registrations.append(await asyncio.to_thread(reg.start))
        return server, port

    async def on_stop() -> None:
        for reg in registrations:
            await asyncio.to_thread(reg.stop)
        close_channels = getattr(servicer, "close_channels", None)  # (a verifier's channels to drafters)
        if close_channels is not None:
            await close_channels()
        servicer.close()

    asyncio.run(serve_forever(start, config.service, role, on_stop))
    return 0


def describe_replica(servicer) -> dict:
    """What a verifier or drafter registers: model, draft head, capacity and load."""
    if hasattr(servicer, "draft_path"):  # a drafter
        return {"model": servicer.config.target or "", "draft": servicer.draft_path,
                "capacity": servicer.config.max_sequences, "load": servicer.drafter.num_sequences}
    return {"model": servicer.target_path, "draft": "", "capacity": servicer.config.max_sequences,
            "load": servicer.num_sequences}


HAND_OVER_ROUND_S = 30.0  # on SIGTERM, wait at most this long for a round in flight before a hand-over


def cmd_coordinator(args: argparse.Namespace) -> int:
    import redis

    from coordinator.config import from_args
    from coordinator.server import build, create_server, with_gateway_token
    from services.rpc.config import ConfigError, configure_logging
    from services.rpc.server import serve_forever

    config = from_args(args)
    configure_logging(config.service.log_level, "coordinator")
    try:
        coordinator = build(config)
    except redis.RedisError as e:
        from services.rpc.security import redact

        raise ConfigError(f"cannot reach Redis at {redact(config.redis_url)}: {e}") from None

    http = None
    ports: dict[str, int] = {}

    own_token = None
    if config.http_port is not None and coordinator.security.api_tokens:
        own_token = with_gateway_token(coordinator)

    async def start():
        nonlocal http
        server, port = await create_server(config.service.address, config, coordinator)
        if config.http_port is not None:  # the OpenAI-compatible API, a gRPC client of this coordinator
            from gateway.server import start_http

            host = config.service.host if config.service.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
            http = await start_http(f"{host}:{port}", config.service.host, config.http_port,
                                    config.service.max_message_bytes, coordinator.security, own_token,
                                    (config.service.tls_cert, config.service.tls_key) if config.service.tls_cert else None,
                                    config.http_limits)
            ports["http_port"] = http.port
        return server, port

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        await asyncio.to_thread(coordinator.close, config.service.drain_s)

    async def on_drain() -> None:  # SIGTERM: sequences still running after AERIE_DRAIN_S go to other coordinators
        await asyncio.to_thread(coordinator.sequences.hand_over_all, config.service.drain_s,
                                min(config.rpc_timeout_s, HAND_OVER_ROUND_S))

    asyncio.run(serve_forever(start, config.service, "coordinator", on_stop, ports, on_drain))
    return 0
