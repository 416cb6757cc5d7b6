"""The SSRF guard's address table (scheduler/special_addresses.py): every block of the IANA
special-purpose registries is refused, in IPv4 and in each IPv6 form that carries an IPv4 address
(IPv4-mapped, NAT64, 6to4, Teredo), and public addresses pass in every form."""

from __future__ import annotations

import ipaddress

import pytest

from scheduler.special_addresses import IPV4_SPECIAL, IPV6_SPECIAL, embedded_ipv4, is_public
from scheduler.webhooks import address_allowed


def teredo(server: str, client: str) -> str:
    """A Teredo address (RFC 4380): 2001:0::/32, the server, flags, port and client obfuscated."""
    value = (0x20010000 << 96) | (int(ipaddress.IPv4Address(server)) << 64) | (0x8000 << 48) | (0xFFFF << 32)
    return str(ipaddress.IPv6Address(value | (int(ipaddress.IPv4Address(client)) ^ 0xFFFFFFFF)))


REFUSED = {
    # IPv4 special-purpose blocks, one address of each
    "0.1.2.3": "this network",
    "10.20.30.40": "private",
    "100.64.0.1": "shared (CGN)",
    "127.0.0.1": "loopback",
    "127.255.255.254": "loopback",
    "169.254.169.254": "link-local, cloud metadata",
    "172.16.5.4": "private",
    "172.31.255.255": "private",
    "192.0.0.9": "IETF protocol assignments",
    "192.0.2.1": "TEST-NET-1",
    "192.31.196.1": "AS112-v4",
    "192.52.193.1": "AMT",
    "192.88.99.1": "6to4 relay anycast",
    "192.168.1.1": "private",
    "192.175.48.1": "AS112 direct delegation",
    "198.18.0.1": "benchmarking",
    "198.19.255.255": "benchmarking",
    "198.51.100.7": "TEST-NET-2",
    "203.0.113.9": "TEST-NET-3",
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "broadcast",
    # IPv6 blocks
    "::": "unspecified",
    "::1": "loopback",
    "::a9fe:a9fe": "IPv4-compatible (::169.254.169.254)",
    "::808:808": "IPv4-compatible, even of a public IPv4 address",
    "64:ff9b:1::a9fe:a9fe": "local-use NAT64",
    "64:ff9b:1::808:808": "local-use NAT64, even of a public IPv4 address",
    "100::1": "discard-only",
    "100:0:0:1::1": "dummy prefix",
    "2001:2::1": "IETF protocol assignments (benchmarking)",
    "2001:10::1": "ORCHID",
    "2001:db8::1": "documentation",
    "3fff::1": "documentation (RFC 9637)",
    "5f00::1": "SRv6 SIDs",
    "fc00::1": "unique-local",
    "fd12:3456::1": "unique-local",
    "fe80::1": "link-local",
    "fe80::1%eth0": "link-local with a zone",
    "fec0::1": "site-local",
    "feff::1": "site-local",
    "ff02::1": "multicast",
    "4000::1": "outside 2000::/3, unallocated",
    # IPv4 carried in IPv6: judged as the IPv4 address
    "64:ff9b::a9fe:a9fe": "NAT64 of 169.254.169.254",
    "64:ff9b::7f00:1": "NAT64 of 127.0.0.1",
    "64:ff9b::a00:1": "NAT64 of 10.0.0.1",
    "::ffff:127.0.0.1": "IPv4-mapped loopback",
    "::ffff:169.254.169.254": "IPv4-mapped metadata",
    "2002:a9fe:a9fe::1": "6to4 of 169.254.169.254",
    "2002:7f00:1::": "6to4 of 127.0.0.1",
    teredo("65.54.227.120", "10.0.0.1"): "Teredo, private client",
    teredo("10.0.0.1", "8.8.8.8"): "Teredo, private server",
    # not addresses
    "not an address": "garbage",
    "": "empty",
    "1.2.3": "short",
}

PUBLIC = [
    "8.8.8.8",
    "93.184.215.14",
    "1.1.1.1",
    "100.63.255.255",  # just below the shared block
    "100.128.0.0",  # just above it
    "172.32.0.1",  # just above 172.16/12
    "198.20.0.1",  # just above benchmarking
    "2606:4700::1111",
    "2a00:1450:4001:82a::200e",
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8: an IPv6-only cluster reaching a public IPv4 receiver
    "::ffff:8.8.8.8",
    "2002:808:808::1",  # 6to4 of 8.8.8.8
    teredo("65.54.227.120", "8.8.4.4"),
]


@pytest.mark.parametrize(("address", "why"), sorted(REFUSED.items()))
def test_special_purpose_addresses_are_refused(address: str, why: str) -> None:
    assert not is_public(address), why
    assert not address_allowed(address, allow_private=False), why


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass_in_every_form(address: str) -> None:
    assert is_public(address)
    assert address_allowed(address, allow_private=False)


def test_every_block_of_the_table_is_refused_at_both_ends() -> None:
    for block in (*IPV4_SPECIAL, *IPV6_SPECIAL):
        for address in (block.network_address, block.broadcast_address):
            assert not is_public(str(address)), (block, address)


def test_the_ipv4_an_ipv6_address_carries_is_found() -> None:
    v4 = ipaddress.IPv4Address
    assert embedded_ipv4(ipaddress.IPv6Address("64:ff9b::a9fe:a9fe")) == (v4("169.254.169.254"),)
    assert embedded_ipv4(ipaddress.IPv6Address("::ffff:10.1.2.3")) == (v4("10.1.2.3"),)
    assert embedded_ipv4(ipaddress.IPv6Address("2002:a9fe:a9fe::1")) == (v4("169.254.169.254"),)
    assert embedded_ipv4(ipaddress.IPv6Address(teredo("65.54.227.120", "10.0.0.1"))) == (
        v4("65.54.227.120"),
        v4("10.0.0.1"),
    )
    assert embedded_ipv4(ipaddress.IPv6Address("2606:4700::1111")) == ()


def test_the_operator_can_allow_private_targets_but_never_multicast_or_unspecified() -> None:
    assert address_allowed("64:ff9b::a9fe:a9fe", allow_private=True)
    assert address_allowed("10.20.30.40", allow_private=True)
    assert not address_allowed("ff02::1", allow_private=True) and not address_allowed(
        "::", allow_private=True
    )
