"""A span per API request (storage/tracing.py), named by its route, carrying its ``x-request-id``.

The span is the root of its trace: a ``traceparent`` the client sends is not followed, since the
header is a tenant's to write (it could pick the trace id, or force sampling of every request).
A batch created by the request stores that span's child (``batch.create``) on its row, so the batch's
validation, units, finalization and webhook deliveries are in the request's trace; the request id,
an attribute of the span, joins it to the request's log lines. Nothing happens with tracing off.
"""

from __future__ import annotations

from typing import Any

from flask import Flask, Response, g, request
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from api.request_ids import ENVIRON_KEY
from storage import tracing


def _start() -> None:
    if not tracing.enabled():
        return
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    span = tracing.tracer().start_span(
        f"{request.method} {route}",
        context=otel_context.Context(),  # a root: see the module docstring
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": request.method,
            "http.route": route,
            tracing.REQUEST_ID: request.environ.get(ENVIRON_KEY, ""),
        },
    )
    g.freight_span = span
    g.freight_span_token = otel_context.attach(trace.set_span_in_context(span))


def _status(response: Response) -> Response:
    span = g.get("freight_span")
    if span is not None:
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR))
    return response


def _end(exc: BaseException | None) -> None:
    span: Any = g.pop("freight_span", None)
    if span is None:
        return
    if exc is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR))
    otel_context.detach(g.pop("freight_span_token"))
    span.end()


def register_request_spans(app: Flask) -> None:
    """Before every other hook, so the span covers the screening and rate limits too."""
    app.before_request(_start)
    app.after_request(_status)
    app.teardown_request(_end)
