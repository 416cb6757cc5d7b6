"""OpenTelemetry traces: off unless an OTLP endpoint is configured, one trace per batch when on.

Configured by the standard variables only (read by the SDK itself): ``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` turns tracing on (spans go there over OTLP/HTTP in
protobuf), ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` sample, ``OTEL_SERVICE_NAME`` names
the process (default ``freight``), ``OTEL_SDK_DISABLED=true`` turns it off again. Without an
endpoint every call here is a no-op span from the API's default tracer: nothing is recorded or sent.

A batch's trace: the API request that created it is the root; its context is stored on the batch's
row (``batches.trace_context``, a W3C ``traceparent``), so every later task about the batch
(validation, its chunks, finalization, webhook deliveries, sent by the API, the tick or an engine
worker) and each of its units' spans on an engine worker join that trace as children of it. Every
task message carries the sender's context in its headers (``storage.broker.TaskQueue``), which a
task that is about no batch (the tick, a pack of many batches' units) continues.

The provider is made lazily in the process that first records a span (after a prefork or gunicorn
worker's fork: a provider made before one is not the child's, which makes its own), so importing
this module costs nothing and starts no thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject

# the message header, and the stored column's format: a W3C trace context
TRACEPARENT = "traceparent"
TRACER_NAME = "freight"
# span attribute names
BATCH_ID = "freight.batch_id"
TENANT = "freight.tenant_id"
MODEL = "freight.model"
UNIT_ID = "freight.unit_id"
REQUEST_ID = "http.request_id"

_lock = threading.Lock()
_provider: dict[int, Any] = {}  # pid -> the SDK TracerProvider made in that process


def enabled() -> bool:
    """An OTLP endpoint is configured and the SDK not disabled: spans are recorded and sent."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _make_provider() -> Any:
    """The SDK's provider: sampler and resource from the OTEL_* variables, a batching OTLP/HTTP
    exporter (spans are sent off the caller's thread, OTEL_BSP_* tune it)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME") or "freight"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def tracer() -> trace.Tracer:
    """This process's tracer: the SDK's when tracing is on, else the API's no-op one."""
    if not enabled():
        return trace.NoOpTracer()
    pid = os.getpid()
    provider = _provider.get(pid)
    if provider is None:
        with _lock:
            provider = _provider.get(pid)
            if provider is None:
                provider = _provider[pid] = _make_provider()
    return provider.get_tracer(TRACER_NAME)


def flush(timeout_millis: int = 5000) -> None:
    """Send the spans this process still holds (a process about to exit, a test)."""
    provider = _provider.get(os.getpid())
    if provider is not None:
        provider.force_flush(timeout_millis)


def shutdown() -> None:
    """Send what this process's provider holds and stop its export thread; a later span makes a
    new provider. For a process whose collector goes away before it does (a test's receiver):
    a provider left running retries its exports against a closed port and logs each failure."""
    provider = _provider.pop(os.getpid(), None)
    if provider is not None:
        provider.shutdown()


def current_traceparent() -> str | None:
    """The current span's context as a ``traceparent`` (what a batch row stores), or None when no
    span is recording."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get(TRACEPARENT)


def headers() -> dict[str, str]:
    """The current context as message headers (empty when no span is current)."""
    carrier: dict[str, str] = {}
    if enabled() and trace.get_current_span().get_span_context().is_valid:
        inject(carrier)
    return carrier


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The context a stored or received ``traceparent`` names (None: none or malformed)."""
    if not traceparent:
        return None
    ctx = extract({TRACEPARENT: traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def links_to(traceparent: str | None) -> list[trace.Link]:
    """A link to the span a stored ``traceparent`` names (none if none): a batch's create to its
    input file's upload, which is a trace of its own (a file may feed many batches)."""
    ctx = context_of(traceparent)
    return [] if ctx is None else [trace.Link(trace.get_current_span(ctx).get_span_context())]


def from_carrier(carrier: Mapping[str, Any] | None) -> otel_context.Context | None:
    value = carrier.get(TRACEPARENT) if carrier else None
    return context_of(value if isinstance(value, str) else None)


@contextmanager
def span(
    name: str,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[trace.Link] = (),
) -> Iterator[trace.Span]:
    """A span made current for the block (``parent``: its parent, else the current span). None
    attribute values are left out. A no-op span when tracing is off."""
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    with tracer().start_as_current_span(name, context=parent, attributes=attrs, links=links) as current:
        yield current
