"""A tenant's webhook receiver for the benchmarks' Freight runs: the client learns a batch ended
when Freight says so, not at its next poll.

A team running jobs of hours polls now and then; a benchmark's jobs last seconds, so a client
sleeping a second between polls adds up to a second to a run that the in-process baselines it is
set beside never pay. Freight sends each tenant's endpoints a signed ``batch.completed`` (or
failed, expired, cancelled) event after the commit that made the batch final
(``workers/webhooks.py``), so ``bench.freight_runner`` registers this receiver for every tenant
(``freight webhooks add``, as an operator would) and sleeps between its polls on :meth:`nap`,
which an event cuts short. The clock still stops at the poll that saw every batch terminal with
its output file: the event only wakes the client for that poll. A lost event costs what it cost
before, the rest of the slow poll.

The receiver does not check signatures: it is reached only from this machine, and what it hears
only decides when the client polls.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 64 * 1024  # Freight's batch events are a few hundred bytes


class BatchEvents:
    """An HTTP server on 127.0.0.1 whose POSTs are batch events; ``events`` holds them in order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._wake = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server calls it by this name
                length = min(int(self.headers.get("Content-Length") or 0), MAX_BODY)
                try:
                    event = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    event = {}
                receiver._arrived(event if isinstance(event, dict) else {})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:  # quiet: the runner logs what matters
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="batch-events", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/batch-events"

    def _arrived(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._wake.set()

    def nap(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less if an event arrives (or arrived since the last nap);
        whether one did. Cleared before the caller's next poll, so no event is slept through."""
        woke = self._wake.wait(seconds)
        self._wake.clear()
        return woke

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
