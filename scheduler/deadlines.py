"""Deadline arithmetic: measured throughput, slack, urgency and at-risk, as pure functions.

Units: time in epoch seconds, rates in requests per second of one model's engines together.
The rate is measured, never assumed: with no sample yet, nothing is called at risk.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.sla import eta


@dataclass(frozen=True)
class Sample:
    """One engine's work over one period (a row of ``engine_samples``)."""

    worker: str
    model: str
    started_at: float
    seconds: float
    requests: int


@dataclass(frozen=True)
class BatchLoad:
    """What is left of one in-progress batch."""

    batch_id: str
    model: str
    deadline: int
    remaining: int  # requests not yet finished


def measured_rates(samples: Iterable[Sample], now: float, window: float) -> dict[str, float]:
    """Requests/s per model while busy: each worker's busy-time rate, summed over its workers.

    Only samples that started within ``window`` of ``now`` count; engines write samples only for
    periods in which they had work, so idle time does not dilute the capacity estimate.
    """
    done: dict[tuple[str, str], int] = defaultdict(int)
    busy: dict[tuple[str, str], float] = defaultdict(float)
    for s in samples:
        if s.started_at < now - window or s.seconds <= 0:
            continue
        done[(s.model, s.worker)] += s.requests
        busy[(s.model, s.worker)] += s.seconds
    rates: dict[str, float] = defaultdict(float)
    for key, seconds in busy.items():
        rates[key[0]] += done[key] / seconds
    return {model: rate for model, rate in rates.items() if rate > 0}


def seconds_needed(requests: int, rate: float | None) -> float:
    """Time to run ``requests`` at ``rate``; 0 when no rate is known yet."""
    if not rate or requests <= 0:
        return 0.0
    return requests / rate


def slack(load: BatchLoad, ahead: int, rate: float | None, now: float) -> float:
    """Seconds to spare: the deadline, less now, less the time to run this batch's rest and the
    ``ahead`` requests that earliest-deadline-first would run before it."""
    return load.deadline - now - seconds_needed(load.remaining + ahead, rate)


def etas(loads: Iterable[BatchLoad], rates: Mapping[str, float], now: float) -> dict[str, float | None]:
    """batch id -> estimated finish (epoch seconds), running each model's batches earliest
    deadline first at its measured rate; None where no rate is known yet."""
    finish: dict[str, float | None] = {}
    by_model: dict[str, list[BatchLoad]] = defaultdict(list)
    for load in loads:
        by_model[load.model].append(load)
    for model, items in by_model.items():
        ahead = 0
        for load in sorted(items, key=lambda b: (b.deadline, b.batch_id)):
            finish[load.batch_id] = eta(load.remaining, ahead, rates.get(model), now)
            ahead += load.remaining
    return finish


# a stored ETA is rewritten once the new one is further from it than this many seconds, or this
# share of the time left to the later of the two: closer than that it is the measured rate's jitter
ETA_STEADY_SECONDS = 5.0
ETA_STEADY_SHARE = 0.02


def eta_moved(stored: float | None, new: float | None, now: float) -> bool:
    """Whether a batch's ETA moved enough to be written again. The tick recomputes every ETA from
    the measured rate every period; rewriting each one that changed by a second updated nearly
    every running batch's row each tick (180 of 250 at a quarter of the fleet simulation), and
    each write waited for, and held up, the unit records updating the same rows."""
    if stored is None or new is None:
        return stored != new
    return abs(new - stored) > max(ETA_STEADY_SECONDS, ETA_STEADY_SHARE * (max(stored, new) - now))


def assess(
    loads: Iterable[BatchLoad], rates: Mapping[str, float], now: float, urgent_slack: float
) -> dict[str, tuple[bool, bool]]:
    """batch id -> (urgent, at_risk).

    Urgent: slack under ``urgent_slack``, so the batch is dispatched strictly by deadline rather
    than sharing the engines fairly, unless it is hopeless: past its deadline, or unable to meet
    it at the measured rate even run alone, ahead of everything. Hurrying a hopeless batch only
    makes others late; it runs at its fair share and expires. At risk: slack below zero at the
    measured rate, counting the work of every batch of its model with an earlier (or equal)
    deadline as ahead of it.
    """
    verdicts: dict[str, tuple[bool, bool]] = {}
    by_model: dict[str, list[BatchLoad]] = defaultdict(list)
    for load in loads:
        by_model[load.model].append(load)
    for model, items in by_model.items():
        rate = rates.get(model)
        ahead = 0
        for load in sorted(items, key=lambda b: (b.deadline, b.batch_id)):
            spare = slack(load, ahead, rate, now)
            hopeless = load.deadline <= now or slack(load, 0, rate, now) < 0
            verdicts[load.batch_id] = (spare < urgent_slack and not hopeless, rate is not None and spare < 0)
            ahead += load.remaining
    return verdicts
