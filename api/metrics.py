"""``GET /metrics``: Prometheus text exposition of queue, worker, cost and SLA figures.

Every value is read from the database at scrape time (``metrics_snapshot``), so any API process
answers the same and nothing is kept in process memory: the collector is built per app on its own
registry (never prometheus_client's global one), and nothing here does I/O at import.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from flask import Flask, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from api.services.monitoring import MetricsSnapshot, metrics_snapshot
from api.services.reports import WORKER_STALE_SECONDS
from workers.runtime import Runtime

# the classic text format every Prometheus reads (newer clients name it CONTENT_TYPE_PLAIN_0_0_4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_WORKER_GAUGES = (
    ("output_tokens_per_second", "Output tokens per second of the worker's latest engine sample."),
    ("prompt_tokens_per_second", "Prompt tokens per second of the worker's latest engine sample."),
    ("batch_fill", "Mean running sequences / max_num_seqs of the worker's latest engine sample."),
    ("cache_hit_rate", "Cached / prompt tokens of the worker's latest engine sample."),
    ("mfu", "Model FLOPs utilisation of the worker's latest engine sample."),
    ("mbu", "Memory bandwidth utilisation of the worker's latest engine sample."),
)


class FreightCollector(Collector):
    """Builds every metric family from one database snapshot per scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def describe(self) -> list[Metric]:
        return []  # registering must not touch the database

    def collect(self) -> Iterator[Metric]:
        yield from families(metrics_snapshot(self.runtime, time.time()))


def families(snap: MetricsSnapshot) -> Iterator[Metric]:
    batches = GaugeMetricFamily("freight_batches", "Batches per status.", labels=["status", "model"])
    for (status, model), n in snap.batches.items():
        batches.add_metric([status, model], n)
    yield batches

    queue = GaugeMetricFamily(
        "freight_queue_requests",
        "Requests of in_progress batches not yet finished.",
        labels=["model"],
    )
    for model, n in snap.queue_requests.items():
        queue.add_metric([model], n)
    yield queue

    units = GaugeMetricFamily("freight_work_units", "Work units per status.", labels=["model", "status"])
    for (model, status), n in snap.work_units.items():
        units.add_metric([model, status], n)
    yield units

    at_risk = GaugeMetricFamily(
        "freight_batches_at_risk",
        "in_progress batches that measured throughput says will miss their deadline.",
        labels=["model"],
    )
    for model, n in snap.batches_at_risk.items():
        at_risk.add_metric([model], n)
    yield at_risk

    for name, doc in _WORKER_GAUGES:
        gauge = GaugeMetricFamily(
            f"freight_worker_{name}",
            f"{doc} Workers without a sample in the last {WORKER_STALE_SECONDS:g} s are left out.",
            labels=["worker", "model"],
        )
        for w in snap.workers:
            value = getattr(w, name)
            if value is not None:
                gauge.add_metric([w.worker, w.model], value)
        yield gauge

    busy = CounterMetricFamily(
        "freight_engine_busy_seconds", "Engine busy seconds, all samples.", labels=["worker", "model"]
    )
    for (worker, model), seconds in snap.engine_busy_seconds.items():
        busy.add_metric([worker, model], seconds)
    yield busy

    engine_cost = CounterMetricFamily(
        "freight_engine_cost_dollars", "Engine cost in dollars, all samples.", labels=["worker", "model"]
    )
    for (worker, model), dollars in snap.engine_cost_dollars.items():
        engine_cost.add_metric([worker, model], dollars)
    yield engine_cost

    tokens = CounterMetricFamily(
        "freight_tokens", "Tokens of finished requests: prompt, cached (part of prompt), output.",
        labels=["model", "kind"],
    )  # fmt: skip
    for (model, kind), n in snap.tokens.items():
        tokens.add_metric([model, kind], n)
    yield tokens

    batch_cost = CounterMetricFamily(
        "freight_batch_cost_dollars",
        "What finished batches were charged: engine cost x tier multiplier, in dollars.",
        labels=["tenant", "model"],
    )
    for (tenant, model), dollars in snap.batch_cost_dollars.items():
        batch_cost.add_metric([tenant, model], dollars)
    yield batch_cost

    sla = CounterMetricFamily(
        "freight_sla_batches", "Final batches with an SLA verdict, by whether they met it.",
        labels=["tenant", "model", "met"],
    )  # fmt: skip
    for (tenant, model, met), n in snap.sla_batches.items():
        sla.add_metric([tenant, model, met], n)
    yield sla

    attainment = GaugeMetricFamily(
        "freight_sla_attainment_ratio",
        "Batches that met their SLA / batches with a verdict, finished in the last 24 h.",
        labels=["tenant", "model"],
    )
    for (tenant, model), ratio in snap.sla_attainment.items():
        attainment.add_metric([tenant, model], ratio)
    yield attainment


def register_metrics(app: Flask) -> CollectorRegistry:
    """Add ``GET /metrics`` (no authentication, like any exporter) reading the app's runtime."""
    registry = CollectorRegistry()
    registry.register(FreightCollector(app.extensions["freight"]))
    app.extensions["freight_metrics"] = registry

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), content_type=CONTENT_TYPE)

    return registry
