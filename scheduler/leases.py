"""Leases, as pure decisions: which running units lost their worker, and the arithmetic of the
time leases (finalization, drop-folder scans and deliveries) that ``storage.leases`` applies.

No database, no clock: the dispatcher passes rows and ``now`` in and applies the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningUnit:
    unit_id: int
    model: str
    heartbeat_at: float | None
    attempts: int


def plan_redelivery(
    running: Iterable[RunningUnit], now: float, lease_seconds: float, max_attempts: int
) -> tuple[list[RunningUnit], list[RunningUnit]]:
    """Units whose worker stopped heartbeating: (to run again, to give up on)."""
    retry: list[RunningUnit] = []
    give_up: list[RunningUnit] = []
    for unit in running:
        if unit.heartbeat_at is not None and now - unit.heartbeat_at <= lease_seconds:
            continue
        (give_up if unit.attempts >= max_attempts else retry).append(unit)
    return retry, give_up


@dataclass(frozen=True)
class QueuedUnit:
    unit_id: int
    model: str
    enqueued_at: float | None


def requeue_after(rate: float | None, lease_seconds: float, depth: int, pack_requests: int) -> float:
    """How long a unit may sit queued before its message counts as lost (seconds).

    A pack task reserved by a worker that then died is invisible in Redis until the visibility
    timeout (hours). A queued pack normally waits behind at most ``depth`` packs, so twice that
    at the measured rate (requests/s), and never less than a lease, is generous.
    """
    if not rate:
        return lease_seconds
    return max(lease_seconds, 2 * depth * pack_requests / rate)


def plan_requeue(
    queued: Iterable[QueuedUnit],
    now: float,
    rates: dict[str, float],
    *,
    lease_seconds: float,
    depth: int,
    pack_requests: int,
    broker_lost: bool = False,
) -> list[QueuedUnit]:
    """Queued units whose message has waited too long: pack and send them again (a late original
    is harmless: the claim lets only one delivery run a unit). ``broker_lost``: the broker lost
    every message it held (a Redis restarted without persistence), so every unit queued before
    ``now`` goes at once."""
    return [
        u
        for u in queued
        if u.enqueued_at is not None
        and (
            (broker_lost and u.enqueued_at <= now)
            or now - u.enqueued_at > requeue_after(rates.get(u.model), lease_seconds, depth, pack_requests)
        )
    ]


# -- time leases: the token is the time the lease was taken or last renewed ----------------------


def lease_cutoff(now: float, lease_seconds: float) -> float:
    """A time lease whose token is older than this has run out: anyone may take it over."""
    return now - lease_seconds


def renewal_due(token: float, now: float, lease_seconds: float) -> bool:
    """Renew a held lease once a quarter of it has gone: often enough that a slow step never lets
    it run out, rarely enough to cost next to nothing."""
    return now - token > lease_seconds / 4


# a validation waiting for its tenant's turn asks again after this long (a message with a countdown)
TENANT_TURN_WAIT_SECONDS = 2.0


def validation_wait(running: int, cap: int, wait: float = TENANT_TURN_WAIT_SECONDS) -> float | None:
    """Whether a tenant's validation may start while ``running`` others of the same tenant hold a
    live validation lease, with at most ``cap`` at once (FREIGHT_TENANT_VALIDATIONS): None if it
    may, else the seconds to wait before asking again. The wait leaves the validation pool to other
    tenants' batches in the meantime; it is neither a retry nor a failure."""
    if running < max(cap, 1):
        return None
    return wait
