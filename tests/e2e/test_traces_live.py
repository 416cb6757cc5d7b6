"""A batch's trace on a live stack of its own (issue #52 part 1): the API, the control worker and
the engine worker send their spans over OTLP/HTTP to a real receiver the test starts
(tests/otlp_receiver.py), and the spans of one batch form one tree: the create request's span, its
``batch.create``, and under that the validation task, each unit (claim, engine, record), the
finalization and the webhook delivery, each carrying the batch id, tenant and model.

Its own stack because the OTEL_* variables are the processes' environment: set on the shared
``live`` stack they would trace every other module's batches too. Kept tiny: one batch of 4 lines
in units of 2, 4 output tokens a line."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import factories, otlp_receiver, webhook_receiver
from tests.e2e.conftest import LiveStack, keep_logs, start_live, wait_final
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.stack

LINES = 4
UNIT_SIZE = 2


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = otlp_receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path, receiver: OtlpReceiver
) -> Iterator[LiveStack]:
    overrides = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "freight-test",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: spans leave each process within a moment
        "FREIGHT_UNIT_SIZE": str(UNIT_SIZE),
        "FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",  # the receiver is on 127.0.0.1
    }
    live_stack, stack = start_live(tmp_path_factory.mktemp("traces"), demo_model, overrides, ("alpha",))
    try:
        yield live_stack
    finally:
        keep_logs(stack, "traces")


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {len(found)} spans"
    return found[0]


def test_a_batch_is_one_trace_from_its_create_to_its_webhook(traced: LiveStack, receiver: OtlpReceiver):
    hooks = webhook_receiver.start()
    try:
        api = httpx.Client(
            base_url=traced.base_url, headers={"Authorization": f"Bearer {traced.keys['alpha']}"}, timeout=60
        )
        hook = api.post("/webhooks", json={"url": hooks.url("/alpha"), "events": ["batch.completed"]})
        assert hook.status_code == 200, hook.text
        lines = [factories.chat_line(f"r{i}", f"hello {i}", max_tokens=4) for i in range(LINES)]
        client = traced.client("alpha")
        file_id = client.files.create(
            file=("t.jsonl", io.BytesIO(factories.jsonl(lines))), purpose="batch"
        ).id
        created = api.post(
            "/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        assert created.status_code == 200, created.text
        batch_id, request_id = created.json()["id"], created.headers["x-request-id"]
        assert wait_final(client, batch_id).status == "completed"
        hooks.wait_for(lambda: len(hooks.at("/alpha")) == 1, timeout=60)
    finally:
        hooks.server.shutdown()
        hooks.server.server_close()

    units = LINES // UNIT_SIZE

    def whole(spans: list[ReceivedSpan]) -> bool:
        names = [s.name for s in spans]
        return names.count("unit.record") >= units and "freight.deliver_webhook" in names

    spans = receiver.wait_for(whole, timeout=60)
    root = next(s for s in spans if s.attributes.get("http.request_id") == request_id)
    assert (root.name, root.parent_id, root.service) == ("POST /v1/batches", "", "freight-test")
    assert root.attributes["http.response.status_code"] == 200
    tree = [s for s in spans if s.trace_id == root.trace_id]
    by_id = {s.span_id: s for s in tree}
    # one tree: every span of the trace but the root has its parent in it
    assert all(s.parent_id in by_id for s in tree if s is not root), sorted(s.name for s in tree)

    create = _one(tree, "batch.create")
    assert create.parent_id == root.span_id
    assert create.attributes == {
        "freight.batch_id": batch_id,
        "freight.tenant_id": create.attributes["freight.tenant_id"],
    }
    # finalization may be sent more than once (by the engine worker after the last unit, and by the
    # tick for a batch finalizing): each run is a child of the batch's span all the same
    finalizations = [s for s in tree if s.name == "freight.finalize_batch"]
    assert finalizations
    tasks = [_one(tree, "freight.validate_batch"), *finalizations, _one(tree, "freight.deliver_webhook")]
    for task in tasks:
        assert task.parent_id == create.span_id, task.name
        assert task.attributes["freight.batch_id"] == batch_id
        assert task.attributes["freight.tenant_id"] == create.attributes["freight.tenant_id"]
    assert all(f.attributes["freight.model"] == "demo" for f in finalizations)
    # a task links to the span that sent it, carried in its message: the API request sent the
    # validation; the webhook delivery was sent by a finalization, or by the tick (which has none)
    assert _one(tree, "freight.validate_batch").links == (root.span_id,)
    assert set(_one(tree, "freight.deliver_webhook").links) <= {f.span_id for f in finalizations}

    unit_spans = [s for s in tree if s.name == "unit"]
    assert len(unit_spans) == units
    packs = {s.span_id: s for s in spans if s.name == "freight.run_pack"}
    for unit in unit_spans:
        assert unit.parent_id == create.span_id
        # linked to the pack that brought it, a root of its own trace (its units may be many batches')
        [pack_id] = unit.links
        assert packs[pack_id].parent_id == "" and packs[pack_id].trace_id != root.trace_id
        assert unit.attributes["freight.model"] == "demo"
        assert unit.attributes["freight.requests"] == UNIT_SIZE
        assert unit.attributes["freight.outcome"] == "recorded"
        assert unit.attributes["freight.engine_seconds"] > 0
        children = sorted((s for s in tree if s.parent_id == unit.span_id), key=lambda s: s.start_ns)
        assert [s.name for s in children] == ["unit.claim", "unit.engine", "unit.record"]
        assert (
            children[0].end_ns <= children[1].start_ns <= children[1].end_ns <= children[2].start_ns + 10**6
        )
    # no span per request line: the trace holds the tasks and units only
    assert len(tree) == 2 + len(tasks) + 4 * units, sorted(s.name for s in tree)

    # the upload is a request of its own, a trace of its own (a file may feed many batches), with
    # its request id too; the batch's create links to it
    upload = next(s for s in spans if s.name == "POST /v1/files")
    assert upload.parent_id == "" and upload.attributes["http.request_id"].startswith("req_")
    assert create.links == (upload.span_id,)
