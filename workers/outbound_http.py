"""HTTP calls to addresses a tenant chose: webhook deliveries (``workers.webhooks``) and image URLs
in chat lines (``workers.images``).

Why one module: both send a request to a URL that is a tenant's input, so both must refuse what
such a URL can aim at inside the deployment. The host is resolved here, every address it resolves
to checked (``scheduler.webhooks.address_allowed``: no loopback, private, link-local such as cloud
metadata at 169.254.169.254, shared or reserved ones unless the operator allows private targets),
and the connection made to the checked address, so a DNS answer that changes between the check and
the connect cannot redirect it (the TLS certificate is still checked against the host name). The
whole call, resolving included, is cut off at its timeout (a server that trickles bytes too), and at
most ``max_bytes`` of the answer are read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

_RESOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="outbound-dns")
REDIRECTS = (301, 302, 303, 307, 308)


class OutboundError(OSError):
    """The call failed before an answer was read whole: refused, unreachable, cut off, too large."""


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the address that was checked, whatever the name resolves to by then."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """The same over TLS; the certificate is checked against the host name (SNI too)."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def resolve(host: str, port: int, timeout: float, allow_private: bool, setting: str) -> str:
    """The address to connect to: the first the host resolves to, when every one is allowed.
    Raises OSError saying why not (``setting``: the operator setting that would allow it)."""
    from scheduler.webhooks import address_allowed

    future = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise OutboundError(f"resolving {host} timed out") from None
    addresses = [str(info[4][0]) for info in infos]
    refused = [a for a in addresses if not address_allowed(a, allow_private)]
    if refused or not addresses:
        raise OutboundError(
            f"refused: {host} resolves to {refused[0] if refused else 'nothing'}, not a public address"
            f" ({setting} is off)"
        )
    return addresses[0]


@dataclass(frozen=True)
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes  # at most the call's max_bytes


@dataclass(frozen=True)
class Call:
    """One call's limits: its whole time (seconds), the answer's bytes read, whether private
    addresses are allowed and the setting that allows them (named in refusals)."""

    timeout: float
    max_bytes: int
    allow_private: bool
    setting: str
    user_agent: str
    refuse_larger: bool = True  # False: read max_bytes of a larger answer and drop the rest


def send(
    method: str, url: str, call: Call, headers: dict[str, str] | None = None, body: bytes | None = None
) -> Answer:
    """One request, no redirect followed; raises OutboundError (TimeoutError: cut off at
    ``call.timeout``), and OutboundError too when the answer holds more than ``call.max_bytes``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn: http.client.HTTPConnection | None = None
    cut_off = threading.Event()
    deadline = time.monotonic() + call.timeout

    def cut() -> None:  # the deadline: a server that trickles bytes is cut off too
        cut_off.set()
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(call.timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        address = resolve(host, port, call.timeout, call.allow_private, call.setting)
        left = max(0.1, deadline - time.monotonic())
        kind = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        conn = kind(host, port, address, left)
        conn.request(method, path, body=body, headers={**(headers or {}), "user-agent": call.user_agent})
        response = conn.getresponse()
        length = response.getheader("content-length")
        too_long = length is not None and length.isdigit() and int(length) > call.max_bytes
        if too_long and call.refuse_larger:
            raise OutboundError(f"the answer is {int(length or 0)} bytes; the limit is {call.max_bytes}")
        data = response.read(call.max_bytes + 1)
        if len(data) > call.max_bytes:
            if call.refuse_larger:
                raise OutboundError(f"the answer is over {call.max_bytes} bytes, the limit")
            data = data[: call.max_bytes]
        return Answer(response.status, response.headers, data)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if cut_off.is_set() or isinstance(exc, TimeoutError):
            raise TimeoutError(f"no answer within {call.timeout:g} s") from None
        if isinstance(exc, OutboundError):
            raise
        raise OutboundError(f"{type(exc).__name__}: {exc}"[:500]) from None
    finally:
        watchdog.cancel()
        if conn is not None:
            conn.close()


def get_following(url: str, call: Call, redirects: int) -> Answer:
    """GET ``url``, following up to ``redirects`` redirects to http(s) URLs, each checked as the
    first was (a redirect to a private address is refused like a link to one); the whole chain
    ends within ``call.timeout``."""
    deadline = time.monotonic() + call.timeout
    for _ in range(redirects + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {call.timeout:g} s")
        try:
            answer = send("GET", url, dataclasses.replace(call, timeout=left))
        except TimeoutError:
            raise TimeoutError(f"no answer within {call.timeout:g} s") from None
        location = answer.headers.get("location")
        if answer.status not in REDIRECTS or not location:
            return answer
        url = urljoin(url, location)
        if urlsplit(url).scheme not in ("http", "https"):
            raise OutboundError("redirected to a URL that is not http(s)")
    raise OutboundError(f"more than {redirects} redirects")
