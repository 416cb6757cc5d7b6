"""``GET /metrics``: Prometheus text exposition of queue, worker, cost and SLA figures.

Every value is read from the database at scrape time (``metrics_snapshot``), so any API process
answers the same and nothing is kept in process memory: the collector is built per app on its own
registry (never prometheus_client's global one), and nothing here does I/O at import.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from flask import Flask, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from api.budget_metrics import BudgetCollector
from api.services.monitoring import MetricsSnapshot, metrics_snapshot
from api.services.operations_metrics import OperationsSnapshot, operations_snapshot
from api.services.readiness import ReadinessProbe
from api.services.reports import WORKER_STALE_SECONDS
from storage.runtime import Runtime

# the classic text format every Prometheus reads (newer clients name it CONTENT_TYPE_PLAIN_0_0_4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Names follow Prometheus' conventions: counters end in _total, units are base units named last
# (_seconds, _dollars), 0-1 gauges end in _ratio, and no gauge is a rate a counter already gives
# (rate(freight_tokens_total[5m]) is a worker's tokens per second). docs/changelog.md lists the
# names these replaced.
_WORKER_RATIOS = (  # (WorkerGauges field, metric, what it is)
    (
        "batch_fill",
        "batch_fill_ratio",
        "Mean running sequences / max_num_seqs of the worker's latest engine sample.",
    ),
    ("cache_hit", "cache_hit_ratio", "Cached / prompt tokens of the worker's latest engine sample."),
    ("mfu", "mfu_ratio", "Model FLOPs utilisation of the worker's latest engine sample."),
    ("mbu", "mbu_ratio", "Memory bandwidth utilisation of the worker's latest engine sample."),
)


class FreightCollector(Collector):
    """Builds every metric family from one database snapshot per scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def describe(self) -> list[Metric]:
        return []  # registering must not touch the database

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        snap = metrics_snapshot(self.runtime, now)
        yield from families(snap)
        models = frozenset(snap.queue_requests)
        yield from operations_families(operations_snapshot(self.runtime, now, models))


class DependencyCollector(Collector):
    """``freight_dependency_up``: the API process's readiness checks (the same probe, and the same
    reuse of a recent result, as ``/readyz``). A database that does not answer fails the whole
    scrape instead (every other figure is read from it): Prometheus' ``up`` is then 0."""

    def __init__(self, probe: ReadinessProbe) -> None:
        self.probe = probe

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield dependency_family({c.name: c.ok for c in self.probe.check().checks})


def dependency_family(checks: Mapping[str, bool]) -> Metric:
    """``freight_dependency_up`` from the readiness checks' outcomes (check name -> ok)."""
    return _family(
        GaugeMetricFamily, "freight_dependency_up",
        "1 when this API process reached the dependency (database, broker, object_store) in its "
        "latest readiness check, else 0.", ["dependency"], {k: float(ok) for k, ok in checks.items()},
    )  # fmt: skip


def _family(kind: type, name: str, doc: str, labels: list[str], values: Mapping[Any, float]) -> Metric:
    """One metric family from a mapping of label values (a tuple, or one string) to numbers."""
    family = kind(name, doc, labels=labels)
    for key, value in values.items():
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


def families(snap: MetricsSnapshot) -> Iterator[Metric]:
    G, C = GaugeMetricFamily, CounterMetricFamily
    yield _family(G, "freight_batches", "Batches per status.", ["status", "model"], snap.batches)
    yield _family(
        G, "freight_queue_requests", "Requests of in_progress batches not yet finished.", ["model"],
        snap.queue_requests,
    )  # fmt: skip
    yield _family(G, "freight_work_units", "Work units per status.", ["model", "status"], snap.work_units)
    yield _family(
        G, "freight_batches_at_risk",
        "in_progress batches that measured throughput says will miss their deadline.", ["model"],
        snap.batches_at_risk,
    )  # fmt: skip
    for field, name, doc in _WORKER_RATIOS:
        values = {(w.worker, w.model): getattr(w, field) for w in snap.workers}
        yield _family(
            G, f"freight_worker_{name}",
            f"{doc} Workers without a sample in the last {WORKER_STALE_SECONDS:g} s are left out.",
            ["worker", "model"], {k: v for k, v in values.items() if v is not None},
        )  # fmt: skip
    # counters: prometheus_client writes a counter's samples as NAME_total whether or not the
    # family's name has it; written out here, so the exposed name is the one in the source
    yield _family(
        C, "freight_engine_busy_seconds_total", "Engine busy seconds, all samples.", ["worker", "model"],
        snap.engine_busy_seconds,
    )  # fmt: skip
    yield _family(
        C, "freight_engine_cost_dollars_total", "Engine cost in dollars, all samples.", ["worker", "model"],
        snap.engine_cost_dollars,
    )  # fmt: skip
    yield _family(
        C, "freight_tokens_total",
        "Tokens of finished requests, prompt or output; a sum over kind counts each token once.",
        ["worker", "model", "kind"], snap.tokens,
    )  # fmt: skip
    yield _family(
        C, "freight_cached_prompt_tokens_total",
        "Prompt tokens served from the prefix cache (part of freight_tokens_total{kind=\"prompt\"}).",
        ["worker", "model"], snap.cached_prompt_tokens,
    )  # fmt: skip
    yield _family(
        C, "freight_engine_preemptions_total",
        "vLLM's preemptions (a running request's KV cache freed for room, its work done again); "
        "counted only where the engine core runs in the worker's process.",
        ["worker", "model"], snap.engine_preemptions,
    )  # fmt: skip
    yield _family(
        C, "freight_batch_cost_dollars_total",
        "What finished batches were charged: engine cost x tier multiplier, in dollars.",
        ["tenant", "model"], snap.batch_cost_dollars,
    )  # fmt: skip
    yield _family(
        C, "freight_sla_batches_total", "Final batches with an SLA verdict, by whether they met it.",
        ["tenant", "model", "met"], snap.sla_batches,
    )  # fmt: skip
    yield _family(
        G, "freight_sla_attainment_ratio",
        "Batches that met their SLA / batches with a verdict, finished in the last 24 h.",
        ["tenant", "model"], snap.sla_attainment,
    )  # fmt: skip


def operations_families(ops: OperationsSnapshot) -> Iterator[Metric]:
    """The gauges the shipped alert rules read (api/services/operations_metrics.py)."""
    G = GaugeMetricFamily
    yield _family(
        G, "freight_engine_workers",
        f"Engine workers seen alive: a sample in the last {WORKER_STALE_SECONDS:g} s or a running "
        "unit's heartbeat within the lease.", ["model"], ops.engine_workers,
    )  # fmt: skip
    yield _family(
        G, "freight_unit_redeliveries",
        "Claims of work units past their first (a worker lost them), units of batches not yet rolled up.",
        ["model"], ops.unit_redeliveries,
    )  # fmt: skip
    yield _family(
        G, "freight_unreclaimed_units",
        "Running work units whose heartbeat stopped three leases ago: the tick takes one back after "
        "one lease, so these mean the tick is late.", ["model"], ops.unreclaimed_units,
    )  # fmt: skip
    yield _family(
        G, "freight_dispatcher_last_tick_timestamp_seconds",
        "When the dispatcher's tick last completed (epoch seconds); no series before the first tick.",
        [], {} if ops.last_tick is None else {(): ops.last_tick},
    )  # fmt: skip
    yield _family(
        G, "freight_request_error_ratio",
        "Failed / finished request lines of the batches that became final in the last hour.",
        ["model"], ops.request_error_ratio,
    )  # fmt: skip
    yield _family(
        G, "freight_waiting_since_timestamp_seconds",
        "When the oldest batch now validating was created, or the oldest now finalizing began "
        "finalizing (epoch seconds); no series while none is.", ["status"], ops.waiting_since,
    )  # fmt: skip
    yield _family(
        G, "freight_webhook_endpoints",
        "Webhook endpoints not removed: active, disabled_by_tenant, or disabled_failing (Freight "
        "disabled it when its deliveries failed for good).", ["tenant", "state"], ops.webhook_endpoints,
    )  # fmt: skip
    yield _family(
        G, "freight_tenant_quota_used", "A tenant's use of a quota (bytes, batches or requests).",
        ["tenant", "quota"], ops.quota_used,
    )  # fmt: skip
    yield _family(
        G, "freight_tenant_quota_limit", "A tenant's quota; no series when it is unlimited.",
        ["tenant", "quota"], ops.quota_limit,
    )  # fmt: skip


def register_metrics(app: Flask) -> CollectorRegistry:
    """Add ``GET /metrics`` reading the app's runtime. It names tenants and their spend, so the
    app's before-request screen guards it (``api.auth.check_metrics_access``): the metrics token,
    or the separate listener of FREIGHT_METRICS_BIND."""
    registry = CollectorRegistry()
    registry.register(FreightCollector(app.extensions["freight"]))
    registry.register(BudgetCollector(app.extensions["freight"]))
    if (probe := app.extensions.get("freight_readiness")) is not None:
        registry.register(DependencyCollector(probe))
    app.extensions["freight_metrics"] = registry

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), content_type=CONTENT_TYPE)

    return registry
