"""storage/tracing.py in one process, against a real OTLP receiver (tests/otlp_receiver.py): off
without an endpoint (no span, no header), on with one; a stored traceparent parents a later span in
the same trace; a batch stores its create span's context and links to its file's upload (migrations
0031 and 0032, SQLite and PostgreSQL)."""

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


def test_migrations_0031_0032_and_a_batch_storing_its_create_span(
    receiver: OtlpReceiver, runtime, settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batches.trace_context and files.trace_context go down and up with 0031 and 0032; a batch
    created under a span stores its batch.create span's context (a child of that span, linked to
    its file's upload), one created with tracing off stores none."""
    from alembic import command
    from sqlalchemy import select

    from api.services.tenants import create_tenant
    from storage.migrate import alembic_config, check, upgrade
    from storage.models import Batch
    from tests import factories
    from tests.conftest import now

    command.downgrade(alembic_config(settings.database_url), "0030")
    upgrade(settings.database_url)
    check(settings.database_url)  # the tables match the models again
    tenant, _ = create_tenant(runtime.db, "alpha", now())
    lines = [factories.chat_line("a", "hi")]
    with tracing.span("a request"):
        traced = factories.upload_and_create(runtime, tenant.id, lines).id
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    untraced = factories.upload_and_create(runtime, tenant.id, lines).id
    with runtime.db.read() as s:
        stored = dict(s.execute(select(Batch.id, Batch.trace_context)).tuples().all())
    assert stored[untraced] is None
    tracing.flush()
    spans = receiver.wait_for(lambda got: len(got) == 2)
    request, create = (next(s for s in spans if s.name == n) for n in ("a request", "batch.create"))
    assert create.parent_id == request.span_id
    assert create.links == (request.span_id,)  # the file was uploaded under the same span
    assert create.attributes == {"freight.batch_id": traced, "freight.tenant_id": tenant.id}
    assert stored[traced].startswith(f"00-{create.trace_id}-{create.span_id}-")  # then its flags
