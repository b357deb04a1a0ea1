"""Local mode (issue 15, "done when"): with no certificates every server still starts; on loopback it
says so ("local mode: loopback only"), and bound beyond loopback without TLS it warns on start-up
(a warning, not a refusal: a private network or a TLS-terminating sidecar is legitimate)."""

import asyncio
import logging

from services.rpc import server as rpc_server
from services.rpc.config import ServiceConfig
from services.rpc.security import Security


def start_and_stop(host: str, service: str, security: Security = Security()) -> None:
    async def run():
        server, port = await rpc_server.create_server(f"{host}:0", ServiceConfig(host=host), service,
                                                      lambda s: [], security)
        assert port > 0
        await server.stop(None)

    asyncio.run(run())


def test_loopback_without_certificates_is_local_mode(caplog):
    with caplog.at_level(logging.INFO, logger="aerie.rpc"):
        start_and_stop("127.0.0.1", "verifier")
    lines = [r for r in caplog.records if "security" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO]
    assert lines[0].getMessage() == ("verifier security: local mode: loopback only; plaintext (no TLS), "
                                     "no internal token")


def test_all_interfaces_without_tls_warns(caplog):
    with caplog.at_level(logging.INFO, logger="aerie.rpc"):
        start_and_stop("0.0.0.0", "coordinator")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["coordinator listens on 0.0.0.0 WITHOUT TLS: anyone on the network can read and send its "
                        "traffic; set AERIE_TLS_CERT/AERIE_TLS_KEY (docs/security.md) or bind 127.0.0.1; "
                        "plaintext (no TLS), no API tokens (every caller is 'anonymous')"]


def test_tls_summary_names_the_controls():
    secured = Security(cert=b"c", key=b"k", ca=b"ca", internal_token="t" * 20)
    assert rpc_server.trust_summary(secured, "drafter", "0.0.0.0:1") == (
        "drafter security: secured; TLS with client certificates (mTLS), internal token required", False)


def test_health_port_serves_health_alone_in_plaintext(tmp_path):
    """AERIE_HEALTH_PORT: for probes that cannot speak TLS (kubelet's), the health service alone on a
    plaintext port, with the TLS port's statuses; every other method is UNIMPLEMENTED there."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from coordinator.redis_server import free_port
    from tests.security.certs import make_pki

    pki = make_pki(tmp_path)
    security = Security(cert=pki.leaf.cert.read_bytes(), key=pki.leaf.key.read_bytes(), ca=pki.ca.cert.read_bytes())
    health_port = free_port()
    config = ServiceConfig(host="127.0.0.1", health_port=health_port)

    async def run():
        server, port = await rpc_server.create_server("127.0.0.1:0", config, "verifier", lambda s: [], security)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                check = health_pb2_grpc.HealthStub(ch).Check
                assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                    health_pb2.HealthCheckResponse.SERVING
                with __import__("pytest").raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary("/aerie.v1.Verifier/GetInfo")(b"", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
                await rpc_server.set_serving(server, False)
                assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await rpc_server.drain(server, 0)

    asyncio.run(run())
