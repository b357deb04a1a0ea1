"""Whom a forwarded call counts as (services/rpc/forwarded.py): only a trusted proxy names the client."""

import pytest

from services.rpc.config import ConfigError
from services.rpc.forwarded import FORWARDED_FOR, TrustedProxies

FWD = ((FORWARDED_FOR, "203.0.113.9"),)


def test_only_a_trusted_proxy_names_the_client():
    loopback = TrustedProxies.parse("127.0.0.1,::1")
    assert loopback.client_host("ipv4:127.0.0.1:5555", FWD) == "ipv4:203.0.113.9"
    assert loopback.client_host("ipv6:[::1]:5555", ((FORWARDED_FOR, b"2001:db8::7"),)) == "ipv6:[2001:db8::7]"
    assert loopback.client_host("ipv4:10.0.0.5:5555", FWD) == "ipv4:10.0.0.5"  # not trusted: its own host
    assert loopback.client_host("ipv4:127.0.0.1:5555", ()) == "ipv4:127.0.0.1"  # nothing forwarded
    pods = TrustedProxies.parse("10.0.0.0/8")
    assert pods.client_host("ipv4:10.1.2.3:4444", FWD) == "ipv4:203.0.113.9"
    assert pods.client_host("ipv4:127.0.0.1:4444", FWD) == "ipv4:127.0.0.1"
    assert TrustedProxies.parse("*").client_host("unix:/tmp/s", FWD) == "ipv4:203.0.113.9"
    assert TrustedProxies.parse("").client_host("ipv4:127.0.0.1:1", FWD) == "ipv4:127.0.0.1"  # none trusted


@pytest.mark.parametrize("value", ["not-an-address", "1.2.3.4, 5.6.7.8", "x" * 65, ""])
def test_a_forwarded_value_that_is_not_an_address_is_ignored(value):
    assert TrustedProxies.parse("127.0.0.1").client_host("ipv4:127.0.0.1:9", ((FORWARDED_FOR, value),)) == \
        "ipv4:127.0.0.1"


def test_a_bad_entry_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="trusted_proxies: '10.0.0.0/33' is not an IP address or network"):
        TrustedProxies.parse("127.0.0.1,10.0.0.0/33")
