"""A real OTLP/HTTP trace receiver on 127.0.0.1 (the tests' collector), built on the SDK's own
protobuf types (``opentelemetry-proto``): no OpenTelemetry Collector installs from the package
registries here (PyPI and Debian have none; Go's module proxy has its sources only).

It answers ``POST /v1/traces`` as a collector does (an empty ExportTraceServiceResponse) and keeps
every span it was sent, flattened with its resource's service name.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    service: str
    attributes: dict[str, Any]
    links: tuple[str, ...]  # the linked spans' ids
    start_ns: int
    end_ns: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def spans_of(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        str(resource.get("service.name", "")),
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple(link.span_id.hex() for link in s.links),
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                    )
                )
    return out


@dataclass
class OtlpReceiver:
    server: ThreadingHTTPServer
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT's value for it (the exporter adds /v1/traces)."""
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float = 60.0
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while not condition(spans := self.received()):
            assert time.monotonic() < deadline, f"spans not received in time: {sorted(s.name for s in spans)}"
            time.sleep(0.1)
        return spans

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def tracing_to(monkeypatch: Any) -> Iterator[OtlpReceiver]:
    """This process's spans (storage/tracing.py) sent to a receiver of its own while the block runs:
    the OTEL_* variables set on ``monkeypatch`` (pytest's), and a new provider made for them."""
    from storage import tracing

    receiver = start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "freight-unit-test")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setattr(tracing, "_provider", {})
    try:
        yield receiver
    finally:
        tracing.shutdown()  # before the receiver goes: no export thread outlives it
        receiver.stop()


def start() -> OtlpReceiver:
    receiver: OtlpReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            spans = spans_of(body)
            with receiver.lock:
                receiver.spans.extend(spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = OtlpReceiver(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver
