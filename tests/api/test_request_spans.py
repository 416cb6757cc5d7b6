"""The API's request spans (api/request_spans.py) through Flask's test client, sent to a real OTLP
receiver (tests/otlp_receiver.py): a span per request, named by its route, with its status and its
x-request-id, and a root whatever traceparent the client sends (the header is a tenant's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient

from storage import tracing
from tests import otlp_receiver
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    with otlp_receiver.tracing_to(monkeypatch) as receiver:
        yield receiver


def test_an_api_request_is_a_root_span_with_its_request_id(
    receiver: OtlpReceiver, client: FlaskClient
) -> None:
    foreign = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    answered = client.get("/v1/files", headers={"x-request-id": "trace-test-1", "traceparent": foreign})
    assert answered.status_code == 401
    client.get("/healthz")
    tracing.flush()
    spans = receiver.wait_for(lambda got: len(got) == 2)
    files = next(s for s in spans if s.name == "GET /v1/files")
    assert files.parent_id == "" and files.trace_id != "0af7651916cd43dd8448eb211c80319c"
    assert files.attributes["http.request_id"] == "trace-test-1"
    assert files.attributes["http.response.status_code"] == 401
    assert files.attributes["http.route"] == "/v1/files"
    assert any(s.name == "GET /healthz" for s in spans)
