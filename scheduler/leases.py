"""Work-unit leases: which running units lost their worker, as a pure decision.

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
