"""workers/task_spans.py against a real OTLP receiver: a task's span links to the sender's context its
message carried; a batch's task whose batch cannot be read (the database unreachable) still runs,
in a span of its own; periodic tasks make none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra import daemons
from storage import tracing
from storage.runtime import Runtime
from storage.settings import Settings
from tests import otlp_receiver
from tests.otlp_receiver import OtlpReceiver
from workers.task_spans import task_span


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    with otlp_receiver.tracing_to(monkeypatch) as receiver:
        yield receiver


def test_a_task_links_its_sender_and_survives_an_unreadable_batch(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    port = daemons.free_port()  # nothing listens: every read of the database fails
    settings = Settings.from_env(
        {},
        data_dir=tmp_path,
        database_url=f"postgresql+psycopg://freight@127.0.0.1:{port}/none?connect_timeout=2",
    )
    rt = Runtime(settings)
    with tracing.span("sender"):
        carried = tracing.headers()
    ran = []
    with task_span(rt, "freight.finalize_batch", SimpleNamespace(**carried), ("batch_x",), periodic=False):
        ran.append("finalize")
    with task_span(rt, "freight.tick", SimpleNamespace(**carried), (), periodic=True):
        ran.append("tick")
    assert ran == ["finalize", "tick"]
    tracing.flush()
    spans = receiver.wait_for(lambda got: len(got) == 2)
    sender = next(s for s in spans if s.name == "sender")
    task = next(s for s in spans if s.name == "freight.finalize_batch")
    assert task.parent_id == "" and task.links == (sender.span_id,)
    assert task.attributes["freight.batch_id"] == "batch_x"
    assert "freight.tenant_id" not in task.attributes
    assert not any(s.name == "freight.tick" for s in receiver.received())
