"""Which IP addresses a URL that a tenant chose may make Freight connect to (webhook receivers,
image links): the IANA special-purpose address registries, IPv4 and IPv6, written out here and
checked beside ``ipaddress``'s own ``is_global``.

Why a table of our own: ``ipaddress``'s lists change between Python releases and miss ranges
(Python 3.11 takes the IPv4-compatible ``::/96``, the site-local ``fec0::/10``, the documentation
prefix ``3fff::/20`` and NAT64's ``64:ff9b::/96`` for global, so ``http://[64:ff9b::a9fe:a9fe]/``
reached the cloud metadata address through a NAT64 gateway). An address is public only when
neither the table nor ``ipaddress`` says otherwise, and an IPv6 address outside ``2000::/3``, the
only block IANA allocates for global unicast, never is. An IPv6 address that carries an IPv4 one
(IPv4-mapped, NAT64's well-known prefix, 6to4, Teredo) reaches that IPv4 address through a
translator or a tunnel, so it is judged as that IPv4 address.
"""

from __future__ import annotations

import ipaddress
from ipaddress import IPv4Address, IPv6Address, ip_network

# IANA IPv4 Special-Purpose Address Registry (and multicast, class E): refused whatever the
# registry's "globally reachable" column says (anycast relays are no tenant's receiver either)
IPV4_SPECIAL = tuple(
    ip_network(block)
    for block in (
        "0.0.0.0/8",  # "this network" (RFC 791)
        "10.0.0.0/8",  # private (RFC 1918)
        "100.64.0.0/10",  # shared address space, carrier-grade NAT (RFC 6598)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local: cloud metadata at 169.254.169.254
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments (DS-Lite, PCP and TURN anycast among them)
        "192.0.2.0/24",  # documentation, TEST-NET-1
        "192.31.196.0/24",  # AS112-v4 (RFC 7535)
        "192.52.193.0/24",  # AMT (RFC 7450)
        "192.88.99.0/24",  # deprecated 6to4 relay anycast (RFC 7526)
        "192.168.0.0/16",  # private
        "192.175.48.0/24",  # direct delegation AS112 service (RFC 7534)
        "198.18.0.0/15",  # benchmarking (RFC 2544)
        "198.51.100.0/24",  # documentation, TEST-NET-2
        "203.0.113.0/24",  # documentation, TEST-NET-3
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved (RFC 1112), the limited broadcast 255.255.255.255 among them
    )
)

# IANA IPv6 Special-Purpose Address Registry, and the deprecated blocks Python calls global
IPV6_SPECIAL = tuple(
    ip_network(block)
    for block in (
        "::/128",  # unspecified
        "::1/128",  # loopback
        "::/96",  # IPv4-compatible, deprecated (RFC 4291): no translator takes it, refused whole
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215): its translation is the site's own
        "100::/64",  # discard-only (RFC 6666)
        "100:0:0:1::/64",  # dummy prefix (RFC 9780)
        "2001::/23",  # IETF protocol assignments (Teredo's 2001::/32 is judged by its IPv4 first)
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
        "5f00::/16",  # segment routing SIDs (RFC 9602)
        "fc00::/7",  # unique-local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local, deprecated (RFC 3879)
        "ff00::/8",  # multicast
    )
)
GLOBAL_UNICAST = ip_network("2000::/3")
NAT64_WELL_KNOWN = ip_network("64:ff9b::/96")  # RFC 6052: the last 32 bits are the IPv4 address


def embedded_ipv4(ip: IPv6Address) -> tuple[IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address leads to through a translator or tunnel (IPv4-mapped,
    NAT64's well-known prefix, 6to4, Teredo's server and client); empty for any other."""
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if ip in NAT64_WELL_KNOWN:
        return (IPv4Address(int(ip) & 0xFFFFFFFF),)
    if ip.sixtofour is not None:
        return (ip.sixtofour,)
    if ip.teredo is not None:
        return ip.teredo
    return ()


def is_public(address: str) -> bool:
    """May a tenant's URL lead Freight here? Only a globally routable unicast address outside every
    special-purpose block; an IPv6 address carrying an IPv4 one only if that IPv4 address is.
    Anything that does not parse (a zone index is dropped first) is not."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, IPv6Address):
        carried = embedded_ipv4(ip)
        if carried:
            return all(_public_ipv4(v4) for v4 in carried)
        return (
            ip in GLOBAL_UNICAST
            and not any(ip in block for block in IPV6_SPECIAL)
            and ip.is_global
            and not ip.is_multicast
        )
    return _public_ipv4(ip)


def _public_ipv4(ip: IPv4Address) -> bool:
    return not any(ip in block for block in IPV4_SPECIAL) and ip.is_global and not ip.is_multicast
