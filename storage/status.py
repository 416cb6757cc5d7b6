"""The batch lifecycle: one enum, one transition table, one ``transition()`` that records when;
and the work units' table, whose moves ``storage.lifecycle.move_units`` applies.

OpenAI's states, plus the paths Freight takes between them. Expiry goes through ``finalizing``
because the done results still have to be assembled into the output file before ``expired``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Protocol

from scheduler.sla import sla_met


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    # the final states, those with no way out (``is_terminal``), as the one tuple every query of
    # final batches filters on (``Batch.status.in_(BatchStatus.FINAL)``)
    FINAL = enum.nonmember((FAILED, COMPLETED, EXPIRED, CANCELLED))

    @property
    def is_terminal(self) -> bool:
        return not TRANSITIONS[self]


S = BatchStatus
TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING, S.FINALIZING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING}),
    S.FINALIZING: frozenset({S.COMPLETED, S.EXPIRED, S.FAILED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.FAILED: frozenset(),
    S.COMPLETED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}

# The timestamp column each state stamps when entered (validating is stamped by created_at).
STAMP = {
    S.IN_PROGRESS: "in_progress_at",
    S.FINALIZING: "finalizing_at",
    S.COMPLETED: "completed_at",
    S.FAILED: "failed_at",
    S.EXPIRED: "expired_at",
    S.CANCELLING: "cancelling_at",
    S.CANCELLED: "cancelled_at",
}


class IllegalTransition(RuntimeError):
    def __init__(self, current: BatchStatus, target: BatchStatus) -> None:
        super().__init__(f"batch cannot go from {current} to {target}")
        self.current = current
        self.target = target


class HasStatus(Protocol):
    status: str
    expires_at: int
    sla_met: bool | None


def transition(batch: HasStatus, target: BatchStatus, now: int) -> None:
    """Move ``batch`` to ``target`` and stamp ``<target>_at`` with ``now`` (epoch seconds).

    A final state records the SLA verdict, except for a file that failed validation: it never
    ran, so it neither meets nor misses its SLA."""
    current = BatchStatus(batch.status)
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(current, target)
    batch.status = target.value
    setattr(batch, STAMP[target], now)
    if target.is_terminal and current != BatchStatus.VALIDATING:
        batch.sla_met = sla_met(now, batch.expires_at, target.value)


# -- work units ----------------------------------------------------------------------------------


class UnitStatus:
    PENDING = "pending"  # made by validation, not yet handed to the broker
    QUEUED = "queued"  # a Celery task for it is in the model's queue
    RUNNING = "running"  # claimed by a worker, which heartbeats while it runs
    DONE = "done"  # results written to the object store, counts recorded
    SKIPPED = "skipped"  # the batch stopped (cancel, expiry) before the unit ran
    FAILED = "failed"  # gave up after repeated worker deaths; its requests become error lines

    FINISHED = (DONE, SKIPPED, FAILED)


U = UnitStatus
# every move a unit's status may make; each is a compare-and-set UPDATE (``storage.lifecycle.move_units``)
UNIT_TRANSITIONS: dict[str, frozenset[str]] = {
    U.PENDING: frozenset({U.QUEUED, U.RUNNING, U.SKIPPED}),  # packed; claimed; its batch stopped
    U.QUEUED: frozenset({U.PENDING, U.RUNNING, U.SKIPPED}),  # message lost; claimed; batch stopped
    U.RUNNING: frozenset({U.DONE, U.PENDING, U.FAILED}),  # recorded; released or lost; given up
    U.DONE: frozenset(),
    U.SKIPPED: frozenset(),
    U.FAILED: frozenset(),
}


class IllegalUnitMove(RuntimeError):
    def __init__(self, current: str, target: str) -> None:
        super().__init__(f"work unit cannot go from {current} to {target}")
        self.current = current
        self.target = target


def unit_sources(from_: str | Iterable[str], to: str) -> tuple[str, ...]:
    """The source states of a unit move, each checked against ``UNIT_TRANSITIONS``; raises
    ``IllegalUnitMove`` for a move the table does not allow (or an unknown state)."""
    sources = (from_,) if isinstance(from_, str) else tuple(from_)
    if not sources:
        raise ValueError("a unit move needs at least one source state")
    for current in sources:
        if to not in UNIT_TRANSITIONS.get(current, ()):
            raise IllegalUnitMove(current, to)
    return sources


# -- validation chunks ---------------------------------------------------------------------------


class ChunkStatus:
    """A chunk of a large input (``storage.models.ValidationChunk``): ``pending`` until a
    validation of it recorded its outputs. While one runs it holds the chunk's time lease; a chunk
    is never made pending again (its outputs are the same however often it is validated)."""

    PENDING = "pending"
    DONE = "done"


CHUNK_TRANSITIONS: dict[str, frozenset[str]] = {
    ChunkStatus.PENDING: frozenset({ChunkStatus.DONE}),
    ChunkStatus.DONE: frozenset(),
}


def chunk_source(to: str) -> str:
    """The one state a chunk may move to ``to`` from (its compare-and-set's WHERE)."""
    [source] = [s for s, targets in CHUNK_TRANSITIONS.items() if to in targets]
    return source


# -- estimates -----------------------------------------------------------------------------------


class EstimateStatus:
    """A dry run (``storage.models.Estimate``): ``validating`` until its task has read the file,
    then ``completed`` (the file would validate; the estimate is there) or ``failed`` (it would not,
    and ``errors`` says why, as a batch's would; or the estimate could not be made)."""

    VALIDATING = "validating"
    COMPLETED = "completed"
    FAILED = "failed"


# every move an estimate's status may make: each is ``storage.lifecycle.move_estimates``'
# compare-and-set UPDATE (its task's answer, its task's fault, the cleanup failing a lost one)
ESTIMATE_TRANSITIONS: dict[str, frozenset[str]] = {
    EstimateStatus.VALIDATING: frozenset({EstimateStatus.COMPLETED, EstimateStatus.FAILED}),
    EstimateStatus.COMPLETED: frozenset(),
    EstimateStatus.FAILED: frozenset(),
}


def estimate_sources(to: str) -> tuple[str, ...]:
    """The states an estimate may move to ``to`` from (its compare-and-set's WHERE); raises
    ValueError for a state nothing moves to."""
    sources = tuple(s for s, targets in ESTIMATE_TRANSITIONS.items() if to in targets)
    if not sources:
        raise ValueError(f"no estimate moves to {to!r}")
    return sources


# -- webhooks ------------------------------------------------------------------------------------


class DeliveryStatus:
    """A webhook delivery (``storage.models.WebhookDelivery``): ``pending`` from the transaction
    that made its batch final until an attempt got a 2xx (``delivered``) or every attempt of the
    retry schedule failed (``failed``)."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


DELIVERY_TRANSITIONS: dict[str, frozenset[str]] = {
    DeliveryStatus.PENDING: frozenset({DeliveryStatus.DELIVERED, DeliveryStatus.FAILED}),
    DeliveryStatus.DELIVERED: frozenset(),
    DeliveryStatus.FAILED: frozenset(),
}


class EndpointStatus:
    """A webhook endpoint: ``active``, or ``disabled`` by its tenant or because its deliveries kept
    failing (the reason is recorded); enabling it again resumes its pending deliveries."""

    ACTIVE = "active"
    DISABLED = "disabled"


ENDPOINT_TRANSITIONS: dict[str, frozenset[str]] = {
    EndpointStatus.ACTIVE: frozenset({EndpointStatus.DISABLED}),
    EndpointStatus.DISABLED: frozenset({EndpointStatus.ACTIVE}),
}


def webhook_source(table: dict[str, frozenset[str]], to: str) -> tuple[str, ...]:
    """The states a delivery or an endpoint may move to ``to`` from (its compare-and-set's WHERE);
    raises ValueError for a state nothing moves to."""
    sources = tuple(s for s, targets in table.items() if to in targets)
    if not sources:
        raise ValueError(f"nothing moves to {to!r}")
    return sources


# -- uploads -------------------------------------------------------------------------------------


class UploadStatus:
    """An upload in parts (``storage.models.Upload``), OpenAI's states: ``pending`` while parts
    arrive; then ``completed`` (its file made), ``cancelled`` by its tenant, or ``expired`` when it
    was still pending at its ``expires_at``. Only a pending upload takes parts or moves."""

    PENDING = "pending"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
