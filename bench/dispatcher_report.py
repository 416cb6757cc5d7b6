"""The fleet-scale dispatcher benchmark's figures, as pure functions of what the run logged and
the database held at its end; and the merge into ``bench/results/control_plane.json``.

Definitions (the ones the report's ``notes`` repeat):

* runnable-to-claim: a unit is runnable once the dispatcher has put it in a pack message on its
  model's queue (``enqueued_at``); claimed when a worker's ``claim_unit`` took it (``started_at``).
  Time a unit waits *pending* behind other pending work is capacity, not dispatch: with 10M requests
  queued for a fleet that serves a fraction of them per minute, it is most of the run;
* fairness: Jain's index (sum x)^2 / (n sum x^2) over x = requests recorded per tenant in each full
  minute of the measured window, every tenant having work waiting all along (all tenants are alike
  in the workload); the target's value is the worst minute of the units not sent as urgent: an
  urgent unit (its batch short of slack for its deadline) goes ahead of its model's fair share by
  design, within its tenant's urgent share, so its tenant is not of equal priority meanwhile. The
  index over all requests, urgent ones too, is reported beside it;
* starvation: a batch starves when, while some of its units were still unclaimed, it went longer
  than ``starve_seconds`` of the measured window with none of its units on a worker (claimed and
  not yet recorded): no service at all. Gaps between claims alone (``longest_gaps``) are reported
  too, but do not make starvation: a batch given many units at once (an urgent one) has no new
  claim while those run, however many of its units are running.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


def summary(values: Sequence[float], digits: int = 4) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, digits)

    return {
        "n": len(values),
        "p50": r(percentile(values, 0.5)),
        "p99": r(percentile(values, 0.99)),
        "max": r(max(values) if values else None),
        "mean": r(sum(values) / len(values) if values else None),
    }


def jain(values: Iterable[float]) -> float | None:
    xs = list(values)
    square = sum(x * x for x in xs)
    if not xs or square == 0:
        return None
    return sum(xs) ** 2 / (len(xs) * square)


def jain_per_window(
    served: Iterable[tuple[float, str, int]],
    tenants: Iterable[str],
    start: float,
    end: float,
    window: float = 60.0,
) -> list[float]:
    """Jain's index of requests served per tenant in each full ``window`` seconds of [start, end);
    ``served`` is (time, tenant, requests). A window in which nothing was served has no index."""
    names = sorted(set(tenants))
    windows = int((end - start) // window)
    counts: list[dict[str, int]] = [defaultdict(int) for _ in range(windows)]
    for at, tenant, n in served:
        k = int((at - start) // window)
        if 0 <= k < windows:
            counts[k][tenant] += n
    out = []
    for served_in in counts:
        index = jain(served_in.get(t, 0) for t in names)
        if index is not None:
            out.append(round(index, 4))
    return out


def longest_gaps(
    claims: Mapping[str, Sequence[float]], last_claim_due: Mapping[str, float], start: float, end: float
) -> dict[str, float]:
    """batch -> the longest stretch of [start, end) with no claim of its units while some were still
    unclaimed; ``last_claim_due[b]``: when batch b's last unit was claimed (absent: some never were,
    so it waited to the end)."""
    out = {}
    for batch, due in last_claim_due.items():
        until = min(end, due)
        times = sorted(t for t in claims.get(batch, ()) if start <= t <= until)
        edges = [start, *times, until]
        out[batch] = max((b - a for a, b in itertools.pairwise(edges)), default=0.0)
    return out


def on_worker(
    claims: Iterable[tuple[int, float]], records: Iterable[tuple[int, float]], end: float
) -> dict[int, list[tuple[float, float]]]:
    """unit -> the stretches it was on a worker: from each claim to the first record after it, or
    to the unit's next claim (the attempt was lost) or ``end`` (still running)."""
    claimed: dict[int, list[float]] = defaultdict(list)
    recorded: dict[int, list[float]] = defaultdict(list)
    for unit, at in claims:
        claimed[unit].append(at)
    for unit, at in records:
        recorded[unit].append(at)
    out: dict[int, list[tuple[float, float]]] = {}
    for unit, times in claimed.items():
        times.sort()
        done = sorted(recorded.get(unit, ()))
        stretches = []
        for k, at in enumerate(times):
            until = times[k + 1] if k + 1 < len(times) else end
            finished = next((r for r in done if at <= r <= until), None)
            stretches.append((at, until if finished is None else finished))
        out[unit] = stretches
    return out


def longest_unserved(
    served: Mapping[str, Sequence[tuple[float, float]]],
    last_claim_due: Mapping[str, float],
    start: float,
    end: float,
) -> dict[str, float]:
    """batch -> the longest stretch of [start, end) in which none of its units was on a worker
    while some were still unclaimed; ``served[b]``: the (from, to) stretches its units were on a
    worker; ``last_claim_due[b]``: when its last unit was claimed (inf: some never were)."""
    out = {}
    for batch, due in last_claim_due.items():
        until = min(end, due)
        longest, covered = 0.0, start  # the stretch of [start, covered) has service or is measured
        for a, b in sorted(served.get(batch, ())):
            if b <= covered:
                continue
            if a > covered:
                longest = max(longest, min(a, until) - covered)
            covered = max(covered, b)
            if covered >= until:
                break
        out[batch] = max(longest, until - covered, 0.0)
    return out


def target(value: float | None, bound: float, op: str) -> dict[str, Any]:
    ok = value is not None and (value <= bound if op == "<=" else value >= bound)
    return {"value": value, "bound": bound, "op": op, "pass": ok}


def merge_results(
    path: Path, section: dict[str, Any], targets: dict[str, Any], name: str = "dispatcher"
) -> None:
    """Write section ``name`` and its targets into ``path`` (bench/results/control_plane.json),
    keeping every other section and target another benchmark wrote there."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = section
    data.setdefault("targets", {}).update(targets)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
