"""A real DNS server on a loopback address, UDP port 53 (the only port resolv.conf can name), for
tests of how Freight's outbound calls resolve a tenant's host names.

Names of ``answers`` get their A record at once (an AAAA query gets an empty answer); a name under
``hang_suffix`` is never answered, as a tenant's hung or deliberately slow DNS would, so the
system resolver waits its whole timeout; any other name is NXDOMAIN. Every query is recorded. A
process uses it when its /etc/resolv.conf names it (``resolv_conf``; ``run_resolving_with``
bind-mounts one over /etc/resolv.conf in a mount namespace of the process's own: root only).
"""

from __future__ import annotations

import random
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


@dataclass
class Query:
    name: str  # lower case, without the final dot
    kind: str  # A, AAAA, ...
    arrived: float  # time.time()


@dataclass
class DNSServer:
    sock: socket.socket
    answers: dict[str, str]
    hang_suffix: str
    queries: list[Query] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return str(self.sock.getsockname()[0])

    def names(self, suffix: str = "", before: float = float("inf")) -> set[str]:
        """The names asked for (ending with ``suffix``) before ``before``."""
        with self.lock:
            return {q.name for q in self.queries if q.name.endswith(suffix) and q.arrived <= before}

    def resolv_conf(self, path: Path, timeout: int) -> Path:
        """A resolv.conf naming only this server: one try of ``timeout`` seconds a query."""
        path.write_text(f"nameserver {self.address}\noptions timeout:{timeout} attempts:1\n")
        return path

    def serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return  # closed
            try:
                query = dns.message.from_wire(data)
                question = query.question[0]
            except Exception:
                continue
            name = question.name.to_text().rstrip(".").lower()
            with self.lock:
                self.queries.append(Query(name, dns.rdatatype.to_text(question.rdtype), time.time()))
            if name.endswith(self.hang_suffix):
                continue  # never answered: the resolver waits its whole timeout
            response = dns.message.make_response(query)
            if name not in self.answers:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text(question.name, 5, "IN", "A", self.answers[name]))
            self.sock.sendto(response.to_wire(), peer)

    def close(self) -> None:
        self.sock.close()


def start(answers: dict[str, str], hang_suffix: str) -> DNSServer:
    """A server on a random 127.x.y.z address, port 53, serving from a daemon thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(20):
        address = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(1, 254)}"
        try:
            sock.bind((address, 53))
            break
        except OSError:
            continue
    else:
        raise OSError("no loopback address had UDP port 53 free")
    server = DNSServer(sock, {k.lower(): v for k, v in answers.items()}, hang_suffix.lower())
    threading.Thread(target=server.serve, name="test-dns", daemon=True).start()
    return server


def run_resolving_with(resolv_conf: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``resolv_conf`` as its /etc/resolv.conf, in a mount namespace of its own
    (the test's process and every other keep the host's): the command to pass to Popen. The
    process is argv's own (``unshare`` and ``sh`` exec it), so its pid is the one to stop."""
    quoted = " ".join(shlex.quote(a) for a in argv)
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f"mount --bind {shlex.quote(str(resolv_conf))} /etc/resolv.conf && exec {quoted}",
    ]
