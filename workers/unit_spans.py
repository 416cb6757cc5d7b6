"""A unit's spans on an engine worker (storage/tracing.py), in its batch's trace.

``unit`` (from the claim's start to its record's end) is a child of the span stored on the batch's
row, linked to its pack's task span (a trace of its own: a pack holds many batches' units), with three children one after another: ``unit.claim`` (the claim's transaction),
``unit.engine`` (its rows read and fed to the engine until its last result settled, the time it
shared the engine with other units; its engine seconds, its share, are an attribute of ``unit``)
and ``unit.record`` (its spools uploaded and the record committed; a batch's finalization sent from
there carries that span in its message). No span per request line: a unit's requests are the
engine loop's, where Freight makes no span: vLLM makes one per request where it traces requests
(the model's ``otlp_traces_endpoint`` engine argument), a child of ``unit.engine``. Spans are made
with explicit times across the feed's, the engine loop's and the recorder's threads, so none is
current on a thread it did not start on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import inject

from storage import tracing
from workers.unit_claims import Claim


@dataclass
class UnitTrace:
    span: trace.Span  # the unit's
    engine: trace.Span  # unit.engine, open until the recorder takes the unit
    # unit.engine's context as W3C trace headers: each of the unit's requests hands them to vLLM
    # (EngineRequest.trace_headers), whose own request span, where it traces, is their child
    headers: dict[str, str]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def claimed(claim: Claim, model: str, started: float) -> UnitTrace | None:
    """The unit's spans from its claim, which began at ``started`` (epoch seconds) and just ended;
    None with tracing off or a batch created with it off."""
    parent = tracing.context_of(claim.trace_context) if tracing.enabled() else None
    if parent is None:
        return None
    tracer = tracing.tracer()
    now = time.time()
    pack = trace.get_current_span().get_span_context()  # the run_pack task's, on the feeding thread
    span = tracer.start_span(
        "unit",
        context=parent,
        links=[trace.Link(pack)] if pack.is_valid else [],
        start_time=_ns(started),
        attributes={
            tracing.BATCH_ID: claim.batch_id,
            tracing.TENANT: claim.tenant_id,
            tracing.MODEL: model,
            tracing.UNIT_ID: claim.unit_id,
            "freight.unit_seq": claim.seq,
            "freight.attempt": claim.attempt,
            "freight.requests": claim.n_requests,
        },
    )
    inside = trace.set_span_in_context(span)
    tracer.start_span("unit.claim", context=inside, start_time=_ns(started)).end(end_time=_ns(now))
    engine = tracer.start_span("unit.engine", context=inside, start_time=_ns(now))
    headers: dict[str, str] = {}
    inject(headers, context=trace.set_span_in_context(engine))
    return UnitTrace(span, engine, headers)


@contextmanager
def _recording(unit_trace: UnitTrace, unit: Any) -> Iterator[None]:
    unit_trace.engine.end()
    tracer = tracing.tracer()
    span = unit_trace.span
    # what the recorder does with it, decided by these flags as it starts (read now: the watcher
    # marks a unit lost once its record has moved it out of running)
    outcome = "lost" if unit.lost else "released" if unit.released else unit.reason or "recorded"
    try:
        with tracer.start_as_current_span("unit.record", context=trace.set_span_in_context(span)):
            yield
    finally:
        span.set_attribute("freight.engine_seconds", unit.meter.engine_seconds)
        span.set_attribute("freight.completed", unit.tally.completed)
        span.set_attribute("freight.failed", unit.tally.failed)
        span.set_attribute("freight.outcome", outcome)
        span.end()


def recording(unit: Any) -> Any:
    """The context the recorder records ``unit`` (a ``workers.runner_state.ActiveUnit``) in: ends
    its engine span, makes its record span current, and ends the unit's span after."""
    unit_trace: UnitTrace | None = unit.trace
    return nullcontext() if unit_trace is None else _recording(unit_trace, unit)
