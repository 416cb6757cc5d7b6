"""vLLM's own request spans joined to a unit's span: an engine started with the model's
``otlp_traces_endpoint`` engine argument sends an ``llm_request`` span per request, a child of the
``unit.engine`` span whose W3C headers the request carried (workers/unit_spans.py ->
EngineRequest.trace_headers -> vLLM's add_request), to a real OTLP/HTTP receiver. An engine started
without it gets no headers. A second engine of its own: vLLM's tracing is set at its start."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from opentelemetry import trace

from tests.otlp_receiver import tracing_to
from tests.workers.test_engine import chat_req
from workers import unit_spans
from workers.engine import Engine, EngineConfig
from workers.unit_claims import Claim


def finish(engine: Engine, *keys: str) -> None:
    left = set(keys)
    for _ in range(2_000):
        left -= {r.key for r in engine.step() if r.ok}
        if not left:
            return
    raise AssertionError(f"not finished: {left}")


@pytest.fixture
def traced(monkeypatch, demo_model_dir):
    """A receiver for both Freight's spans and vLLM's, and an engine that traces its requests."""
    with tracing_to(monkeypatch) as receiver:
        # vLLM's exporter speaks gRPC unless told; init_otel_tracer writes the endpoint into the
        # environment (restored by monkeypatch once set through it)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        monkeypatch.setenv(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        )
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        engine = Engine.start(
            EngineConfig(
                model_path=str(demo_model_dir),
                served_name="demo",
                max_num_seqs=4,
                kv_cache_bytes=16 * 1024 * 1024,
                enforce_eager=True,
                default_max_tokens=4,
                engine_args={"otlp_traces_endpoint": f"{receiver.endpoint}/v1/traces"},
            )
        )
        try:
            yield receiver, engine
        finally:
            engine.shutdown()
            # vLLM's provider is the process's global one from here on (set once): its spans sent
            # while the receiver is up, then shut, or every later engine's start-up spans (vLLM's
            # @instrument) would be exported to the closed port, logging each failure mid-test
            provider = trace.get_tracer_provider()
            provider.force_flush()
            provider.shutdown()


def test_vllm_request_spans_are_children_of_the_units_engine_span(traced) -> None:
    receiver, engine = traced
    assert engine.traces_requests
    claim = Claim(
        unit_id=7, token="w:1:x", attempt=1, batch_id="batch_t", endpoint="/v1/chat/completions",
        shard_key="s", seq=0, n_requests=2, tenant_id="tenant_t",
        trace_context="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )  # fmt: skip
    unit_trace = unit_spans.claimed(claim, "demo", started=0.0)
    assert unit_trace is not None and set(unit_trace.headers) == {"traceparent"}
    engine_span = unit_trace.engine.get_span_context()
    for key in ("a", "b"):
        assert engine.add(replace(chat_req(key, max_tokens=3), trace_headers=unit_trace.headers)) is None
    assert engine.add(chat_req("untraced", max_tokens=3)) is None
    finish(engine, "a", "b", "untraced")
    unit_trace.engine.end()
    unit_trace.span.end()
    from storage import tracing

    tracing.flush()
    spans = receiver.wait_for(lambda s: sum(x.name == "llm_request" for x in s) >= 3, timeout=60)
    requests = [s for s in spans if s.name == "llm_request"]
    joined = [s for s in requests if s.parent_id == format(engine_span.span_id, "016x")]
    assert len(joined) == 2  # the unit's two requests, under unit.engine in the batch's trace
    assert {s.trace_id for s in joined} == {"0af7651916cd43dd8448eb211c80319c"}
    (engine_received,) = [s for s in spans if s.name == "unit.engine"]
    assert engine_received.span_id == format(engine_span.span_id, "016x")
    (alone,) = [s for s in requests if s not in joined]
    assert alone.trace_id != "0af7651916cd43dd8448eb211c80319c"  # no headers: a trace of its own


def test_an_engine_without_vllm_tracing_gets_no_headers(vllm_engine) -> None:
    """The shared engine was started without otlp_traces_endpoint: requests' headers are dropped
    before vLLM (which would otherwise keep them on every request for nothing)."""
    assert not vllm_engine.traces_requests
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    assert vllm_engine.add(replace(chat_req("h", max_tokens=2), trace_headers=headers)) is None
    finish(vllm_engine, "h")
