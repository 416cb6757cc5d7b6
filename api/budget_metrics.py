"""``/metrics``' budget gauges: each tenant's monthly spend budget (``freight tenant budget``) and
what it spent of it this month, read from the database at scrape time like every other figure
(``api/metrics.py`` registers the collector on the app's own registry)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.budgets import BudgetState
from scheduler.cost import MICROS_PER_DOLLAR
from storage.budgets import month_figures
from storage.runtime import Runtime


class BudgetCollector(Collector):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def describe(self) -> list[Metric]:
        return []  # registering must not touch the database

    def collect(self) -> Iterator[Metric]:
        with self.runtime.db.read() as s:
            figures = month_figures(s, time.time())
        yield from budget_families(figures)


def budget_families(figures: list[tuple[str, BudgetState]]) -> Iterator[Metric]:
    """Three gauges labelled by tenant name; a tenant without a budget has no sample."""
    specs = (
        ("freight_tenant_budget_dollars", "The tenant's spend budget for the calendar month (UTC).",
         lambda st: st.budget_micros / MICROS_PER_DOLLAR),
        ("freight_tenant_budget_spent_dollars",
         "What the tenant's batches created this month (UTC) were charged so far, running ones included.",
         lambda st: st.spent_micros / MICROS_PER_DOLLAR),
        ("freight_tenant_budget_used_ratio",
         "Spent / budget this month: the tenant.budget_warning event is recorded at "
         "FREIGHT_BUDGET_WARNING_RATIO, and a hard budget refuses new batches at 1.",
         lambda st: st.ratio),
    )  # fmt: skip
    for name, doc, value in specs:
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant, state in figures:
            family.add_metric([tenant], value(state))
        yield family
