"""HTTP calls to addresses a tenant chose: webhook deliveries (``workers.webhooks``) and image URLs
in chat lines (``workers.images``).

Why one module: both send a request to a URL that is a tenant's input, so both must refuse what
such a URL can aim at inside the deployment. The host is resolved here, every address it resolves
to checked (``scheduler.webhooks.address_allowed``: no loopback, private, link-local such as cloud
metadata at 169.254.169.254, shared or reserved ones unless the operator allows private targets),
and the connection made to the checked address, so a DNS answer that changes between the check and
the connect cannot redirect it (the TLS certificate is still checked against the host name). The
whole call, resolving included, is cut off at its timeout (a server that trickles bytes too), and at
most ``max_bytes`` of the answer are read. A refusal tells the tenant that the address is not
allowed, never which address its host resolved to (that would map the deployment's internal names
for it); the operator's log names it.

Host lookups are per tenant (``TenantLookups``): ``getaddrinfo`` cannot be cancelled, so a lookup
its call gave up on runs on in its thread until the system resolver ends it. Each lookup has a
thread of its own, and at most ``Call.tenant_lookups`` of one tenant's run at once in a process,
those given up on included: a tenant whose DNS hangs waits for its own lookups, within its calls'
deadlines, and never occupies a pool the other tenants' lookups need (a shared pool of four threads
did: a victim's lookup timed out behind an attacker's hung ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

log = logging.getLogger(__name__)

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


class TenantLookups:
    """Host lookups, each in a thread of its own, at most ``limit`` of one tenant's running at once
    in this process (a lookup whose caller gave up counts until it ends). A tenant's lookup waits
    for one of its own to end, never for another tenant's."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running: dict[str, int] = {}  # tenant -> lookups in their threads; no key at 0

    def lookup(self, host: str, port: int, tenant: str, limit: int, deadline: float) -> list[str]:
        """The addresses ``host`` resolves to, by ``deadline`` (``time.monotonic()``) or
        OutboundError; the system resolver's own error (an OSError) as it is."""
        with self._changed:
            while self._running.get(tenant, 0) >= max(1, limit):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OutboundError(f"resolving {host} timed out: the tenant's earlier lookups still run")
                self._changed.wait(left)
            self._running[tenant] = self._running.get(tenant, 0) + 1
        found: list[list[str]] = []
        failed: list[OSError] = []
        ended = threading.Event()

        def run() -> None:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                found.append([str(info[4][0]) for info in infos])
            except OSError as exc:
                failed.append(exc)
            finally:
                with self._changed:
                    left_running = self._running[tenant] - 1
                    if left_running:
                        self._running[tenant] = left_running
                    else:
                        del self._running[tenant]
                    self._changed.notify_all()
                ended.set()

        threading.Thread(target=run, name="outbound-dns", daemon=True).start()
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            raise OutboundError(f"resolving {host} timed out")
        if failed:
            raise failed[0]
        return found[0]


LOOKUPS = TenantLookups()


def resolve(host: str, port: int, call: Call, deadline: float) -> str:
    """The address to connect to: the first the host resolves to, when every one is allowed.
    Raises OSError saying why not, naming the operator setting that would allow it but not the
    address (the operator's log has it)."""
    from scheduler.webhooks import address_allowed

    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        addresses = LOOKUPS.lookup(host, port, call.tenant, call.tenant_lookups, deadline)
    else:  # an address as the host: nothing to look up
        addresses = [host]
    refused = [a for a in addresses if not address_allowed(a, call.allow_private)]
    if refused or not addresses:
        log.warning(
            "outbound call of tenant %s refused: %s resolves to %s (%s is off)",
            call.tenant or "-", host, refused[0] if refused else "nothing", call.setting,
        )  # fmt: skip
        what = "an address that is not allowed" if refused else "no address"  # the tenant's: none named
        raise OutboundError(
            f"refused: {host} resolves to {what}: not a public address ({call.setting} is off)"
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
    tenant: str = ""  # whose call: its host lookups are counted against this tenant (TenantLookups)
    tenant_lookups: int = 2  # of this tenant's lookups running at once in this process, at most


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
        address = resolve(host, port, call, deadline)
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
