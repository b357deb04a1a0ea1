"""Who an HTTP caller is when the gateway makes the gRPC call for it: `aerie-forwarded-for` metadata.

Without API tokens a caller is counted by its peer host (the per-client stream limit, the admission
queue's turns, the verifier's KV shares). Every HTTP caller reaches the coordinator from the gateway's
address, so without this they would all be one client. The gateway sends the HTTP caller's address
as `aerie-forwarded-for`; the coordinator believes it only from a peer in its trusted proxies
(AERIE_TRUSTED_PROXIES: addresses or networks, default loopback, `*` = any peer), as uvicorn's
`--forwarded-allow-ips` does for X-Forwarded-For. From any other peer it is ignored: a direct gRPC
caller cannot choose whom it is counted as.

    proxies = TrustedProxies.parse("127.0.0.1,::1,10.0.0.0/8")   # ConfigError naming a bad entry
    proxies.client_host(context.peer(), metadata)  # 'ipv4:203.0.113.9' (forwarded) or the peer's host
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from services.rpc.config import ConfigError
from services.rpc.security import peer_host

FORWARDED_FOR = "aerie-forwarded-for"
DEFAULT_TRUSTED_PROXIES = "127.0.0.1,::1"
_MAX_CHARS = 64  # an address (IPv6 with a zone fits); anything longer is not one


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """'ipv4:1.2.3.4' / 'ipv6:[::1]' / '1.2.3.4' / '::1' -> the address; None for anything else."""
    for prefix in ("ipv4:", "ipv6:"):
        host = host.removeprefix(prefix)
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class TrustedProxies:
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    any_peer: bool = False

    @classmethod
    def parse(cls, text: str) -> TrustedProxies:
        entries = [e.strip() for e in text.split(",") if e.strip()]
        if "*" in entries:
            return cls(any_peer=True)
        networks = []
        for e in entries:
            try:
                networks.append(ipaddress.ip_network(e, strict=False))
            except ValueError:
                raise ConfigError(f"trusted_proxies: {e!r} is not an IP address or network "
                                  "(AERIE_TRUSTED_PROXIES: comma-separated, '*' = any peer, '' = none)") from None
        return cls(tuple(networks))

    def trusts(self, peer: str) -> bool:
        if self.any_peer:
            return True
        address = _address(peer_host(peer))
        return address is not None and any(address in n for n in self.networks)

    def client_host(self, peer: str, metadata) -> str:
        """The caller's host: the forwarded one when a trusted proxy sent a valid address, else the peer's."""
        forwarded = next((v for k, v in metadata or () if k == FORWARDED_FOR), None)
        if isinstance(forwarded, bytes):
            forwarded = forwarded.decode(errors="replace")
        if forwarded and len(forwarded) <= _MAX_CHARS and self.trusts(peer):
            address = _address(forwarded)
            if address is not None:
                return f"ipv{address.version}:{address}" if address.version == 4 else f"ipv6:[{address}]"
        return peer_host(peer)
