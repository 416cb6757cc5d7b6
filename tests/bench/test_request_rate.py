"""bench/request_rate.py's pure parts: the workload's shape and the profile summary."""

from __future__ import annotations

from bench.request_rate import OUTPUT_TOKENS, lines, paired_ratios, per_thousand, rate_cell, top_functions


def test_lines_are_unique_tiny_and_seeded() -> None:
    first = lines(500, seed=1)
    assert first == lines(500, seed=1)
    assert first != lines(500, seed=2)
    prompts = [line["body"]["messages"][0]["content"] for line in first]
    assert len(set(prompts)) == 500
    assert len({line["custom_id"] for line in first}) == 500
    budgets = {line["body"]["max_tokens"] for line in first}
    assert budgets == set(range(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1))
    assert all(line["body"]["ignore_eos"] for line in first)


def test_top_functions_counts_own_and_total_samples() -> None:
    raw = "\n".join(
        [
            "main (a/run.py:1);loop (a/run.py:9);parse (b/json.py:4) 6",
            "main (a/run.py:1);loop (a/run.py:9);parse (b/json.py:5) 2",
            "main (a/run.py:1);loop (a/run.py:12) 2",
            "garbage line",
        ]
    )
    summary = top_functions(raw)
    assert summary["samples"] == 10
    assert summary["own"][0] == ("json.py:parse", 0.8)  # two lines of one function merged
    assert dict(summary["own"])["run.py:loop"] == 0.2
    assert dict(summary["total"])["run.py:main"] == 1.0


def test_a_freight_cell_keeps_where_its_wall_time_went() -> None:
    phases = {"to_units": 1.6, "to_engine": 0.01, "engine": 19.4, "to_final": 0.1}
    freight = rate_cell({"wall_s": 21.1, "cpu_s": {}, "batch_fill": 0.46, "phases_s": phases}, 20_000)
    assert freight["phases_s"] == phases and freight["batch_fill"] == 0.46
    assert freight["requests_per_s"] == 20_000 / 21.1
    engine = rate_cell({"wall_s": 20.0, "cpu_s": {}}, 20_000)  # an engine's run has neither
    assert "phases_s" not in engine and "batch_fill" not in engine


def test_cpu_per_thousand_requests() -> None:
    assert per_thousand({"control": 3.0, "api": 0.5}, 20_000) == {"control": 0.15, "api": 0.025}
    assert per_thousand({"control": 3.0}, 0) == {}


def test_freight_is_paired_with_the_faster_engine_of_each_repeat() -> None:
    runs = {
        "engine_process": [{"requests_per_s": 100.0}, {"requests_per_s": 120.0}, {"requests_per_s": 100.0}],
        "engine_inline": [{"requests_per_s": 125.0}, {"requests_per_s": 110.0}, {"requests_per_s": None}],
        "freight": [{"requests_per_s": 100.0}, {"requests_per_s": 96.0}, {"requests_per_s": 90.0}],
    }
    assert paired_ratios(runs) == {
        # repeat 3 lacks the inline engine's figure: no ratio to the faster engine there
        "freight_over_engine": [100 / 125, 96 / 120],
        "freight_over_engine_process": [100 / 100, 96 / 120, 90 / 100],
        "freight_over_engine_inline": [100 / 125, 96 / 110],
    }


def test_a_repeat_with_errors_counts_for_no_ratio_of_that_system() -> None:
    runs = {
        "engine_process": [{"requests_per_s": 100.0}, {"requests_per_s": 100.0}],
        "engine_inline": [{"requests_per_s": 90.0, "errors": 1}, {"requests_per_s": 80.0}],
        "freight": [{"requests_per_s": 99.0}, {"requests_per_s": 99.0, "errors": 3}],
    }
    assert paired_ratios(runs) == {
        "freight_over_engine": [],
        "freight_over_engine_process": [99 / 100],
        "freight_over_engine_inline": [],
    }


def test_a_baseline_revisions_freight_is_paired_repeat_by_repeat() -> None:
    """``--baseline-rev``: Freight over the same stack at another revision, run in the same turns."""
    runs = {
        "engine_process": [{"requests_per_s": 100.0}, {"requests_per_s": 100.0}],
        "engine_inline": [{"requests_per_s": 110.0}, {"requests_per_s": 90.0}],
        "freight": [{"requests_per_s": 99.0}, {"requests_per_s": 88.0}],
        "freight_baseline": [{"requests_per_s": 90.0}, {"requests_per_s": 80.0, "errors": 2}],
    }
    assert paired_ratios(runs) == {
        "freight_over_engine": [99 / 110, 88 / 100],
        "freight_over_engine_process": [99 / 100, 88 / 100],
        "freight_over_engine_inline": [99 / 110, 88 / 90],
        "freight_over_baseline": [99 / 90],  # its second repeat had errors
    }


def test_the_traced_stack_is_paired_with_the_plain_one_repeat_by_repeat() -> None:
    """``--tracing``: tracing_over_plain, the traced Freight's requests/s over the plain one's."""
    runs = {
        "engine_process": [{"requests_per_s": 100.0}, {"requests_per_s": 100.0}],
        "engine_inline": [{"requests_per_s": 110.0}, {"requests_per_s": 90.0}],
        "freight": [{"requests_per_s": 99.0}, {"requests_per_s": 88.0}],
        "freight_tracing": [{"requests_per_s": 90.0, "errors": 1}, {"requests_per_s": 80.0}],
    }
    ratios = paired_ratios(runs)
    assert ratios["tracing_over_plain"] == [80 / 88]  # its first repeat had errors
    assert ratios["freight_over_engine"] == [99 / 110, 88 / 100]  # the traced stack is no engine
    plain = {k: v for k, v in runs.items() if k != "freight_tracing"}
    assert "tracing_over_plain" not in paired_ratios(plain)


def test_the_otlp_sink_counts_the_spans_an_sdk_exporter_sends() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from bench.otlp_sink import OtlpSink

    sink = OtlpSink()
    try:
        provider = TracerProvider()
        exporter = OTLPSpanExporter(endpoint=f"{sink.endpoint}/v1/traces")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("bench-test")
        with tracer.start_as_current_span("outer"):
            for i in range(4):
                tracer.start_span(f"inner-{i}").end()
        provider.shutdown()
        assert sink.counts() == (5, 5)  # one export per span with the simple processor
    finally:
        sink.stop()
