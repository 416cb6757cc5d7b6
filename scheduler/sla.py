"""SLAs: completion-window tiers, ETAs, admission against a deadline, and SLA attainment.

Units: time in epoch seconds (durations in seconds). Pure functions; the dispatcher and the
reports apply them to rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from scheduler.durations import parse_duration


@dataclass(frozen=True)
class SlaTier:
    window: str  # as written, e.g. "24h"
    seconds: int
    price_multiplier: float


def parse_tiers(text: str) -> tuple[SlaTier, ...]:
    """Parse "1h:2,4h:1.5,24h:1,7d:0.75" (window:multiplier; no ':m' means 1.0) into tiers, in the
    given order. Durations are NUMBER + s|m|h|d and must come to at least one second; two windows of
    the same length (even "24h" and "1d") are duplicates. Raises ValueError naming the bad entry."""
    if not text.strip():
        raise ValueError("no SLA tiers given (expected e.g. '1h:2,24h:1')")
    tiers: list[SlaTier] = []
    seen: dict[int, str] = {}
    for raw in text.split(","):
        entry = raw.strip()
        window, sep, mult_text = (part.strip() for part in entry.partition(":"))
        try:
            seconds = round(parse_duration(window))
        except ValueError:
            seconds = 0
        if seconds < 1:
            raise ValueError(f"SLA tier {entry!r}: bad duration {window!r} (expected NUMBER + s|m|h|d)")
        try:
            multiplier = float(mult_text) if sep else 1.0
        except ValueError:
            multiplier = math.nan
        if not (math.isfinite(multiplier) and multiplier > 0):
            raise ValueError(f"SLA tier {entry!r}: multiplier {mult_text!r} is not a positive number")
        if seconds in seen:
            raise ValueError(f"SLA tier {entry!r}: duplicate window (same as {seen[seconds]!r})")
        seen[seconds] = window
        tiers.append(SlaTier(window, seconds, multiplier))
    return tuple(tiers)


def eta(remaining_requests: int, ahead_requests: int, rate: float | None, now: float) -> float | None:
    """Epoch seconds when a batch should finish if the ``ahead`` requests (earlier deadlines) run
    first at the measured ``rate`` (requests/s): ``now`` when nothing remains, None with no rate."""
    if remaining_requests <= 0:
        return now
    if rate is None or rate <= 0:
        return None
    return now + (max(ahead_requests, 0) + remaining_requests) / rate


def sla_met(finished_at: float | None, deadline: float, status: str) -> bool | None:
    """True for a completion at or before the deadline; False for a late completion, an expiry or
    a failure while running; None while not final (``finished_at`` is None) and for a cancelled
    batch, which its owner stopped (a file that fails validation never gets a verdict either:
    see ``storage.status.transition``)."""
    if finished_at is None or status == "cancelled":
        return None
    return status == "completed" and finished_at <= deadline


@dataclass(frozen=True)
class AdmissionDecision:
    accept: bool
    warning: str | None  # human-readable, names the ETA and the deadline in ISO-8601 UTC


ADMISSION_POLICIES = ("off", "warn", "refuse")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def admit(eta_at: float | None, deadline: float, policy: str, window: str) -> AdmissionDecision:
    """Whether to take a batch whose estimated finish ``eta_at`` may be after its ``deadline``.

    An unknown ETA is never held against a batch. Past the deadline, "off" accepts silently, "warn"
    accepts with a warning, "refuse" rejects with the reason and a suggested longer window.
    """
    if policy not in ADMISSION_POLICIES:
        raise ValueError(f"unknown admission policy {policy!r} (expected off, warn or refuse)")
    if eta_at is None or eta_at <= deadline or policy == "off":
        return AdmissionDecision(accept=True, warning=None)
    when = f"at {_iso(eta_at)}, after its {window} deadline {_iso(deadline)}"
    if policy == "warn":
        return AdmissionDecision(True, f"batch is expected to finish {when}; a longer completion_window fits")
    return AdmissionDecision(False, f"batch would finish {when}; retry with a longer completion_window")


@dataclass(frozen=True)
class BatchOutcome:
    tenant: str
    model: str
    finished_at: float | None  # when it reached a final status; None while not final
    sla_met: bool | None  # the verdict recorded then; None: no verdict (cancelled, invalid file)
    requests_completed: int


@dataclass(frozen=True)
class SlaSummary:
    tenant: str
    model: str
    batches: int  # batches that ended (final) in the window
    met: int  # of those, sla_met True
    attainment: float | None  # met / batches, None if batches == 0
    goodput_batches_per_hour: float  # met batches / window hours
    goodput_requests_per_hour: float  # completed requests of met batches / window hours


def sla_summary(outcomes: Iterable[BatchOutcome], since: float, until: float) -> list[SlaSummary]:
    """Per (tenant, model), over batches with an SLA verdict whose ``finished_at`` is in
    [since, until), sorted by (tenant, model), then one row for everything with tenant and model
    "*" (always present).

    Goodput counts only batches that met their deadline, so late work adds nothing to it.
    """
    if until <= since:
        raise ValueError(f"empty window: until ({until}) <= since ({since})")
    hours = (until - since) / 3600
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # batches, met, requests
    everything = [0, 0, 0]
    for o in outcomes:
        if o.finished_at is None or o.sla_met is None or not since <= o.finished_at < until:
            continue
        met = o.sla_met
        for acc in (counts[(o.tenant, o.model)], everything):
            acc[0] += 1
            acc[1] += met
            acc[2] += o.requests_completed if met else 0
    keyed = [(key, counts[key]) for key in sorted(counts)] + [(("*", "*"), everything)]
    return [
        SlaSummary(
            tenant, model, batches, met, met / batches if batches else None, met / hours, requests / hours
        )
        for (tenant, model), (batches, met, requests) in keyed
    ]
