"""A real HTTP server on 127.0.0.1 that receives webhook deliveries (the tests' receivers).

Each path behaves as the test sets it: answer 200, answer 500 the first N times, or wait before
answering. Every request is recorded (path, headers, body, when it arrived and was answered).
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from scheduler.webhooks import signature


def verify(secret: str, sent: dict[str, str], body: bytes) -> bool:
    """What a receiver does with a delivery (Standard Webhooks): it is genuine if any ``v1,``
    signature of the header is the one ``secret`` makes of its id, timestamp and body."""
    expected = signature(secret, sent["webhook-id"], int(sent["webhook-timestamp"]), body)
    return any(hmac.compare_digest(expected, candidate) for candidate in sent["webhook-signature"].split())


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    arrived: float
    answered: float = 0.0
    status: int = 0


@dataclass
class Behaviour:
    fail_first: int = 0  # answer 500 to this many requests, then 200
    wait: float = 0.0  # seconds before answering
    status: int = 200  # the answer once the failures are used up (302: a redirect)
    body_bytes: int = 2  # how much the answer's body holds


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def at(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "condition not met in time"
            time.sleep(0.02)


def start() -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            arrived = time.time()
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            entry = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body, arrived)
            behaviour = receiver.behaviours.get(self.path, Behaviour())
            with receiver.lock:
                receiver.received.append(entry)
                seen = sum(1 for r in receiver.received if r.path == self.path)
            if behaviour.wait:
                time.sleep(behaviour.wait)
            status = 500 if seen <= behaviour.fail_first else behaviour.status
            # recorded before the answer goes out: the sender may read it back the moment it has
            # the answer, before this thread runs again
            entry.status = status
            try:
                self.send_response(status)
                self.send_header("content-length", str(behaviour.body_bytes))
                if status == 302:
                    self.send_header("location", "http://169.254.169.254/latest/meta-data/")
                self.end_headers()
                for _ in range(0, behaviour.body_bytes, 65536):
                    self.wfile.write(b"x" * min(65536, behaviour.body_bytes))
            except OSError:  # the sender gave up on us
                pass
            entry.answered = time.time()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(server)
    # polled every 0.05 s: shutdown() waits up to one poll (0.5 s by default, at each teardown)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return receiver
