"""Usage and cost per LoRA adapter (``freight report --by-adapter``): the lines each adapter served,
per tenant, from its base's batches that finished in a window.

Each work unit records its adapter lines' requests and tokens (``work_units.adapter_usage``,
written by the engine worker); an adapter's cost is its share of each unit's charge, kind by
kind: the unit's uncached-input, cached-input and output charges split by the adapter's tokens of
that kind (the engine time a kind of token costs is the same for a base's line and an adapter's:
they run in the same engine steps). The report's rows per model count the adapters' lines too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select

from api.services.reports import in_window
from scheduler.cost import MICROS_PER_DOLLAR
from storage.models import Batch, Tenant, WorkUnit
from storage.runtime import Runtime


@dataclass(frozen=True)
class AdapterRow:
    tenant: str
    base: str
    adapter: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: float  # dollars, as charged (the tier's multiplier applied)


def _share(charge: float, part: int, whole: int) -> float:
    return charge * part / whole if whole > 0 else 0.0


def adapter_report(
    rt: Runtime, since: float, until: float, tenant: str | None = None, model: str | None = None
) -> list[AdapterRow]:
    """One row per (tenant name, base, adapter) sorted; ``model`` keeps one base's adapters."""
    query = (
        select(
            Tenant.name,
            Batch.model,
            Batch.price_multiplier,
            WorkUnit.adapter_usage,
            WorkUnit.prompt_tokens,
            WorkUnit.cached_tokens,
            WorkUnit.completion_tokens,
            WorkUnit.cost_input_micros,
            WorkUnit.cost_cached_micros,
            WorkUnit.cost_output_micros,
        )
        .select_from(WorkUnit)
        .join(Batch, Batch.id == WorkUnit.batch_id)
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(*in_window(since, until), WorkUnit.adapter_usage.is_not(None))
    )
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    if model is not None:
        query = query.where(Batch.model == model)
    sums: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0, 0, 0.0])
    with rt.db.read() as s:
        for name, base, mult, usage, prompt, cached, output, c_in, c_cached, c_out in s.execute(query):
            uncached = max(0, int(prompt) - int(cached))
            for adapter, (requests, a_prompt, a_cached, a_output) in (usage or {}).items():
                row = sums[(name, base or "-", adapter)]
                row[0] += requests
                row[1] += a_prompt
                row[2] += a_cached
                row[3] += a_output
                charge = (
                    _share(c_in, max(0, a_prompt - a_cached), uncached)
                    + _share(c_cached, a_cached, int(cached))
                    + _share(c_out, a_output, int(output))
                )
                row[4] += charge * float(mult or 1.0)
    return [
        AdapterRow(t, b, a, int(v[0]), int(v[1]), int(v[2]), int(v[3]), round(v[4]) / MICROS_PER_DOLLAR)
        for (t, b, a), v in sorted(sums.items())
    ]
