"""Freight against the limit (issue #51): the arithmetic of bench/scheduler.py's limit ratios, their
targets and repeats, and the engine worker's own CPU beside vLLM's.

The limit of a workload is vLLM's engine in-process (bench/engine_baseline.py: stats logging off,
its core where Freight's engine worker puts it, warmed on the same shape) on the lines sorted by
rendered prompt (``engine_sorted``) where the benchmark sorts them, else on the lines as written
(``engine``: unique and multi_job, whose prompts share nothing); in tenant cache-sharing mode the
engine on the lines sorted by tenant, then prompt, each with its tenant's ``cache_salt``
(``engine_sorted_tenant``). A ratio is Freight's output rate over the limit's, repeat by repeat on
the same file (other prompts each repeat), and the target is on their median; min and max go with it.
"""

from __future__ import annotations

import statistics
from typing import Any

LIMIT_BOUND = 0.97  # every workload, every mode: Freight end to end >= 0.97 x the limit
DUPS_BOUND = 1.2  # dups: duplicates run once (the ideal with 20% duplicates is 1.25)
MJSP = "multi_job_shared_prefix"

# per workload: the ratio fields against the limit -> (Freight's cell, the limit's cell)
LIMIT_FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "unique": {"freight_over_limit": ("freight", "engine")},
    "multi_job": {
        "freight_over_limit": ("freight", "engine"),  # 20 batches of 3 tenants, global sharing
        "freight_tenant_over_limit": ("freight_tenant", "engine"),  # the same, tenant sharing
    },
    MJSP: {
        "freight_single_job_over_limit": ("freight_single_job", "engine_sorted"),
        "freight_over_limit": ("freight", "engine_sorted"),  # 3 tenants x 2 jobs, global
        "freight_per_tenant_1job_over_limit": ("freight_per_tenant_1job", "engine_sorted_tenant"),
        "freight_per_tenant_over_limit": ("freight_per_tenant", "engine_sorted_tenant"),
    },
}
DEFAULT_FIELDS = {"freight_over_limit": ("freight", "engine_sorted")}


def fields_of(name: str) -> dict[str, tuple[str, str]]:
    return LIMIT_FIELDS.get(name, DEFAULT_FIELDS)


def bound_of(name: str) -> float:
    return DUPS_BOUND if name == "dups" else LIMIT_BOUND


def group_key(name: str, kv: str) -> str:
    """The ratio group of a workload at a KV size (as bench/scheduler.py's compute_ratios names it)."""
    return name if kv == "default" else f"{name}_{kv}_kv"


def limit_targets(workloads: tuple[str, ...], kv_configs: tuple[str, ...]) -> dict[str, tuple[str, float]]:
    """{"GROUP.FIELD": (">=", bound)} for every workload, KV size and limit field."""
    return {
        f"{group_key(name, kv)}.{field}": (">=", bound_of(name))
        for name in workloads
        for kv in kv_configs
        for field in fields_of(name)
    }


def repeat_rates(cell: dict[str, Any] | None) -> list[float | None]:
    """Output tok/s of each repeat of a cell (bench/scheduler.py combine_repeats keeps them in
    order), or of the cell itself when it is one run; None for a failed repeat."""
    if not cell or ("error" in cell and "repeats" not in cell):
        return []
    if "repeats" in cell:
        return [r.get("output_tok_s") if not r.get("errors") else None for r in cell["repeats"]]
    return [cell.get("output_tok_s")]


def paired_ratios(mine: dict[str, Any] | None, limit: dict[str, Any] | None) -> list[float]:
    """Repeat r of ``mine`` over repeat r of ``limit`` (the same file), skipping failed repeats."""
    return [a / b for a, b in zip(repeat_rates(mine), repeat_rates(limit), strict=False) if a and b]


def limit_ratio_lists(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """{group: {field: [per repeat]}} for every cell pair of LIMIT_FIELDS both measured."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, by_kv in results.items():
        for kv, cells in by_kv.items():
            for field, (mine, limit) in fields_of(name).items():
                values = paired_ratios(cells.get(mine), cells.get(limit))
                if values:
                    out.setdefault(group_key(name, kv), {})[field] = values
    return out


def spread(values: list[float]) -> dict[str, Any] | None:
    """{repeats, min, median, max} of per-repeat values (None without any)."""
    if not values:
        return None
    return {
        "repeats": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "values": values,
    }


def _worker_cpu(cpu: dict[str, float]) -> tuple[float, float]:
    """(front end, children) CPU seconds of Freight's engine workers in a run's cpu_s by role."""
    own = sum(v for k, v in cpu.items() if k.startswith("engine-") and not k.endswith("/children"))
    children = sum(v for k, v in cpu.items() if k.startswith("engine-") and k.endswith("/children"))
    return own, children


def cpu_figures(cell: dict[str, Any] | None, freight: bool) -> dict[str, Any] | None:
    """CPU seconds of the process that ran the engine, per engine step and per request, in ms.

    Freight: its engine workers (the front end process, where an inline core also runs vLLM's
    scheduler and model, and ``/children``), over ``engine_steps`` from its engine_samples. The
    engine baseline: its process and children over its measured call, steps from its unmeasured
    stats run of the same lines. Both count all of vLLM's work too: the difference is Freight's own."""
    if not cell or "error" in cell or not isinstance(cell.get("cpu_s"), dict):
        return None
    cpu = cell["cpu_s"]
    if freight:
        own, children = _worker_cpu(cpu)
        steps = cell.get("engine_steps")
    else:
        own, children = cpu.get("engine", 0.0), cpu.get("engine/children", 0.0)
        steps = cell.get("steps")
    total, requests = own + children, cell.get("requests")
    return {
        "cpu_s": round(total, 3),
        "front_end_cpu_s": round(own, 3),
        "children_cpu_s": round(children, 3),
        "steps": steps,
        "requests": requests,
        "cpu_ms_per_step": round(1000 * total / steps, 3) if steps else None,
        "cpu_ms_per_request": round(1000 * total / requests, 3) if requests else None,
    }


def engine_cpu(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per group: Freight's engine worker CPU per step and per request beside the limit's (vLLM
    alone on the same lines), and Freight's own = the difference."""
    out: dict[str, dict[str, Any]] = {}
    for name, by_kv in results.items():
        for kv, cells in by_kv.items():
            entry: dict[str, Any] = {}
            for mine, limit in fields_of(name).values():
                worker, vllm = cpu_figures(cells.get(mine), True), cpu_figures(cells.get(limit), False)
                if worker is None or vllm is None:
                    continue
                own = {
                    f"freight_own_{unit}": round(worker[unit] - vllm[unit], 3)
                    if worker[unit] is not None and vllm[unit] is not None
                    else None
                    for unit in ("cpu_ms_per_step", "cpu_ms_per_request")
                }
                entry[mine] = {"engine_worker": worker, limit: vllm, **own}
            if entry:
                out[group_key(name, kv)] = entry
    return out


CPU_NOTE = (
    "engine_cpu: CPU of the process that ran the engine, per engine step and per request, in ms "
    "(psutil user+system over the measured run). Freight: its engine worker (front end process, "
    "which with the inline core also runs vLLM's scheduler and model threads, plus children), steps "
    "from its engine_samples; the limit: the engine baseline's process and children over its "
    "measured call, steps from its unmeasured stats run of the same lines. Both include all of "
    "vLLM's work, so freight_own_* (worker minus limit) is what Freight's engine worker spends "
    "beyond vLLM on the same lines: its loop, recorder and watcher threads, rendering of what it "
    "did not prepare at validation; step counts differ where Freight batches differently"
)
