"""storage/tracing.py in one process, against a real OTLP receiver (tests/otlp_receiver.py): off
without an endpoint (no span, no header), on with one; a stored traceparent parents a later span in
the same trace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from storage import tracing
from tests import otlp_receiver
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    with otlp_receiver.tracing_to(monkeypatch) as receiver:
        yield receiver


def test_off_without_an_endpoint_records_and_carries_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not tracing.enabled()
    with tracing.span("nothing") as span:
        assert not span.is_recording()
        assert tracing.headers() == {} and tracing.current_traceparent() is None


def test_disabled_by_the_sdk_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.enabled()


def test_a_stored_traceparent_parents_a_later_span(receiver: OtlpReceiver) -> None:
    with tracing.span("first", attributes={tracing.BATCH_ID: "batch_x", tracing.MODEL: None}):
        stored = tracing.current_traceparent()
        carried = tracing.headers()
    assert stored is not None and carried == {"traceparent": stored}
    with tracing.span("later", tracing.context_of(stored)):
        pass
    with tracing.span("unrelated", tracing.context_of("00-not-a-context")):
        pass
    tracing.flush()
    spans = receiver.wait_for(lambda got: len(got) == 3)
    first, later, unrelated = (next(s for s in spans if s.name == n) for n in ("first", "later", "unrelated"))
    assert first.attributes == {"freight.batch_id": "batch_x"}  # None attributes left out
    assert (later.trace_id, later.parent_id) == (first.trace_id, first.span_id)
    assert unrelated.parent_id == "" and unrelated.trace_id != first.trace_id
    assert {s.service for s in spans} == {"freight-unit-test"}
