"""Who the client is behind a reverse proxy: ``X-Forwarded-For`` and ``X-Forwarded-Proto`` believed
only when the connection comes from a proxy listed in ``FREIGHT_TRUSTED_PROXIES``.

Anyone can send those headers, so honouring them from every peer would let a client pick its own
address (a fresh anonymous rate-limit bucket per request) or claim HTTPS. From a trusted peer,
the client is the rightmost address of ``X-Forwarded-For`` that is not itself a trusted proxy:
each proxy appends the address it saw, so the entries left of the first untrusted one are
whatever the client wrote and are not read. The peer's own address stays in
``environ["freight.peer_addr"]``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
SCHEMES = ("http", "https")


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        return None


class TrustedProxies:
    """WSGI middleware: rewrite ``REMOTE_ADDR`` and ``wsgi.url_scheme`` from the forwarded headers
    of trusted proxies, and leave every other request as the server saw it."""

    def __init__(self, app: Callable[..., Any], proxies: Iterable[str]) -> None:
        self.app = app
        self.networks: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(p, strict=False) for p in proxies)

    def trusted(self, text: str) -> bool:
        address = _address(text)
        return address is not None and any(address in network for network in self.networks)

    def client(self, peer: str, forwarded_for: str) -> str:
        """The client's address: walk the chain from the right over trusted proxies."""
        client = peer
        for hop in reversed([h.strip() for h in forwarded_for.split(",") if h.strip()]):
            if _address(hop) is None:
                break  # not an address: a proxy that does not append, or a forgery; stop here
            client = hop
            if not self.trusted(hop):
                break
        return client

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        peer = environ.get("REMOTE_ADDR", "")
        environ["freight.peer_addr"] = peer
        if self.trusted(peer):
            environ["REMOTE_ADDR"] = self.client(peer, environ.get("HTTP_X_FORWARDED_FOR", ""))
            proto = environ.get("HTTP_X_FORWARDED_PROTO", "").split(",")[-1].strip().lower()
            if proto in SCHEMES:
                environ["wsgi.url_scheme"] = proto
        return self.app(environ, start_response)
