"""A minimal OTLP/HTTP trace receiver for benchmarks: answers ``POST /v1/traces`` as a collector
does and counts the spans it was sent (decoded with opentelemetry-proto's types), keeping none.

``bench/request_rate.py --tracing`` points a Freight stack's ``OTEL_EXPORTER_OTLP_ENDPOINT`` at it,
so tracing's cost is measured with spans really exported (encoded, sent over loopback HTTP); it
runs in the benchmark's own process, on the same machine as the stack (a real collector's own
work is elsewhere and not counted).
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpSink:
    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                n = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                with sink._lock:
                    sink.spans += n
                    sink.exports += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT's value for it (the exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def counts(self) -> tuple[int, int]:
        """(spans, export requests) received so far."""
        with self._lock:
            return self.spans, self.exports

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
