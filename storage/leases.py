"""Leases on rows, as compare-and-set UPDATEs inside the caller's transaction.

A lease is a column holding its holder's token: a worker's claim on a work unit (``worker``), or
the time a time lease was taken or last renewed (``finalizer_heartbeat_at``, ``scan_lease_at``,
``delivery_lease_at``, a webhook attempt's ``lease_at`` and ``busy_at``, ...). It is free while
the column is NULL and, for a time lease, once the token is older than ``lease_seconds``. Taking,
renewing and releasing each name the row and check the lease in the WHERE, so of two writers
racing only one wins, and a holder whose lease was taken over changes nothing.

Every write of a lease column goes through this module: through the ``LeaseKeeper`` of each lease
of the schema (``KEEPERS``), built on this module's private functions
(``tests/storage/test_row_leases.py`` reads the product source for any other write). A work unit's
lease moves the unit's status with it, and then the keeper writes through
``storage.lifecycle.move_units``, the one mover of unit status.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, or_, update
from sqlalchemy.orm import InstrumentedAttribute, Session

from scheduler.leases import lease_cutoff
from storage.lifecycle import IDS_PER_STATEMENT, move_units, move_units_by_id
from storage.models import (
    Batch,
    DropFolder,
    DropObject,
    Estimate,
    ValidationChunk,
    WebhookDelivery,
    WebhookEndpoint,
    WorkUnit,
)


def _column(model: type[Any], column: str) -> InstrumentedAttribute[Any]:
    attr = getattr(model, column)
    assert isinstance(attr, InstrumentedAttribute), f"{model.__name__}.{column} is not a column"
    return attr


def lease_free(
    model: type[Any], column: str, now: float | None = None, lease_seconds: float | None = None
) -> ColumnElement[bool]:
    """No live lease: the column is NULL or (a time lease, given ``now`` and ``lease_seconds``)
    its token is older than the lease."""
    col = _column(model, column)
    if lease_seconds is None:
        return col.is_(None)
    assert now is not None, "a time lease needs now"
    return or_(col.is_(None), col < lease_cutoff(now, lease_seconds))


def _update(s: Session, model: type[Any], *where: Any, **values: Any) -> int:
    return int(cast(CursorResult[Any], s.execute(update(model).where(*where).values(**values))).rowcount)


def _set(s: Session, model: type[Any], *where: Any, **values: Any) -> bool:
    return bool(_update(s, model, *where, **values))


def _take_lease(
    s: Session,
    model: type[Any],
    row_id: object,
    column: str,
    token: object,
    *extra_where: Any,
    now: float | None = None,
    lease_seconds: float | None = None,
    **values: Any,
) -> bool:
    """Set the row's ``column`` to ``token`` (and ``values``) if its lease is free (see
    ``lease_free``) and ``extra_where`` holds; True if this call took it."""
    return _set(
        s,
        model,
        model.id == row_id,
        lease_free(model, column, now, lease_seconds),
        *extra_where,
        **{column: token},
        **values,
    )


def _renew_lease(
    s: Session, model: type[Any], row_id: object, column: str, token: object, new_token: object
) -> bool:
    """Replace the token of a lease still held under ``token``; False (nothing changed) if it was
    taken over or released meanwhile."""
    return _set(s, model, model.id == row_id, _column(model, column) == token, **{column: new_token})


def _release_lease(
    s: Session, model: type[Any], row_id: object, column: str, token: object, **values: Any
) -> bool:
    """Give back a lease still held under ``token``, setting ``values`` with it; False (nothing
    changed) if it was taken over or released meanwhile."""
    return _set(s, model, model.id == row_id, _column(model, column) == token, **{column: None}, **values)


@dataclass(frozen=True)
class LeaseKeeper:
    """Every write of one lease: its table and column. ``take``, ``renew`` and ``release`` check
    the holder's token (a holder whose lease was taken over changes nothing); ``revoke`` alone ends
    a lease whoever holds it, for the one who decides the row's fate over the holder's head.

    A move (``from_`` and ``to``, unit states) makes the write a unit status move through
    ``move_units``: a unit's lease is taken with its move to ``running`` and ends with its move
    out of it, in one compare-and-set."""

    model: type[Any]
    column: str

    def free(self, now: float | None = None, lease_seconds: float | None = None) -> ColumnElement[bool]:
        return lease_free(self.model, self.column, now, lease_seconds)

    def take(
        self,
        s: Session,
        row_id: object,
        token: object,
        *where: Any,
        now: float | None = None,
        lease_seconds: float | None = None,
        from_: str | Iterable[str] | None = None,
        to: str | None = None,
        **values: Any,
    ) -> bool:
        """Hold the row's lease under ``token`` if it is free (see ``lease_free``) and ``where``
        holds; True if this call took it."""
        if to is None:
            return _take_lease(s, self.model, row_id, self.column, token, *where, now=now,
                              lease_seconds=lease_seconds, **values)  # fmt: skip
        assert from_ is not None, "a unit move needs its source states"
        free = self.free(now, lease_seconds)
        return bool(move_units(s, self.model.id == row_id, free, *where, from_=from_, to=to,
                               **{self.column: token}, **values))  # fmt: skip

    def renew(self, s: Session, row_id: object, token: object, new_token: object) -> bool:
        """Move a lease still held under ``token`` to ``new_token`` (a time lease: the time of the
        renewal); False, and nothing changed, if it was taken over or released meanwhile."""
        return _renew_lease(s, self.model, row_id, self.column, token, new_token)

    def release(
        self,
        s: Session,
        row_id: object,
        token: object,
        *where: Any,
        from_: str | Iterable[str] | None = None,
        to: str | None = None,
        **values: Any,
    ) -> bool:
        """Give back a lease still held under ``token``, setting ``values`` with it; False, and
        nothing changed, if it was taken over or released meanwhile."""
        if to is None and not where:
            return _release_lease(s, self.model, row_id, self.column, token, **values)
        held = (self.model.id == row_id, _column(self.model, self.column) == token, *where)
        if to is None:
            return _set(s, self.model, *held, **{self.column: None}, **values)
        assert from_ is not None, "a unit move needs its source states"
        return bool(move_units(s, *held, from_=from_, to=to, **{self.column: None}, **values))

    def revoke(
        self,
        s: Session,
        ids: list[Any],
        *where: Any,
        from_: str | Iterable[str] | None = None,
        to: str | None = None,
        **values: Any,
    ) -> int:
        """End the leases of the rows ``ids`` (that match ``where``) whoever holds them, setting
        ``values``; how many rows changed. For the one that decides over the holder's head: the
        tick taking back units whose heartbeats stopped, the task policy failing a batch whose
        task failed for good (its token is the failed task's own, which the policy is not given)."""
        if to is not None:
            assert from_ is not None, "a unit move needs its source states"
            return move_units_by_id(s, ids, *where, from_=from_, to=to, **{self.column: None}, **values)
        changed = 0
        for k in range(0, len(ids), IDS_PER_STATEMENT):
            chunk = self.model.id.in_(ids[k : k + IDS_PER_STATEMENT])
            changed += _update(s, self.model, chunk, *where, **{self.column: None}, **values)
        return changed


# every lease of the schema: a worker process's claim on a work unit (its token: a claim token,
# workers/identity.py), and the time leases (their token: the time they were taken or last
# renewed) of a batch's finalizer and validation, a validation chunk's, an estimate's (its dry
# run's task reading the file), a drop folder's scan, a drop object's delivery, and a webhook
# attempt's two: its delivery's (one attempt of a delivery at a time) and its endpoint's (one
# attempt in flight to an endpoint at a time)
UNIT_LEASE = LeaseKeeper(WorkUnit, "worker")
FINALIZER_LEASE = LeaseKeeper(Batch, "finalizer_heartbeat_at")
VALIDATION_LEASE = LeaseKeeper(Batch, "validation_heartbeat_at")
VALIDATION_CHUNK_LEASE = LeaseKeeper(ValidationChunk, "lease_at")
ESTIMATE_LEASE = LeaseKeeper(Estimate, "lease_at")
SCAN_LEASE = LeaseKeeper(DropFolder, "scan_lease_at")
DELIVERY_LEASE = LeaseKeeper(DropObject, "delivery_lease_at")
WEBHOOK_DELIVERY_LEASE = LeaseKeeper(WebhookDelivery, "lease_at")
WEBHOOK_ENDPOINT_LEASE = LeaseKeeper(WebhookEndpoint, "busy_at")
KEEPERS = (
    UNIT_LEASE,
    FINALIZER_LEASE,
    VALIDATION_LEASE,
    VALIDATION_CHUNK_LEASE,
    ESTIMATE_LEASE,
    SCAN_LEASE,
    DELIVERY_LEASE,
    WEBHOOK_DELIVERY_LEASE,
    WEBHOOK_ENDPOINT_LEASE,
)
