"""Pure dispatch decisions over frozen snapshots: which units to queue, which to redeliver.

No database, no clock: the dispatcher passes rows and ``now`` in and applies the answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PendingUnit:
    unit_id: int
    model: str
    deadline: int  # epoch seconds: the batch's expires_at
    batch_created_at: int
    seq: int


@dataclass(frozen=True)
class RunningUnit:
    unit_id: int
    model: str
    heartbeat_at: float | None
    attempts: int


def plan_enqueue(pending: Iterable[PendingUnit], queued: Mapping[str, int], depth: int) -> list[PendingUnit]:
    """Earliest deadline first, then oldest batch, then file order; at most ``depth`` queued per model."""
    room = {}
    chosen: list[PendingUnit] = []
    for unit in sorted(pending, key=lambda u: (u.deadline, u.batch_created_at, u.seq, u.unit_id)):
        free = room.setdefault(unit.model, depth - queued.get(unit.model, 0))
        if free > 0:
            chosen.append(unit)
            room[unit.model] = free - 1
    return chosen


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
