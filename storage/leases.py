"""Leases on rows, as compare-and-set UPDATEs inside the caller's transaction.

A lease is a column holding its holder's token: a worker's claim on a work unit (``worker``), or
the time a time lease was taken or last renewed (``finalizer_heartbeat_at``, ``scan_lease_at``,
``delivery_lease_at``). It is free while the column is NULL and, for a time lease, once the token
is older than ``lease_seconds``. Taking, renewing and releasing each name the row and check the
lease in the WHERE, so of two writers racing only one wins, and a holder whose lease was taken
over changes nothing.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, or_, update
from sqlalchemy.orm import InstrumentedAttribute, Session

from scheduler.leases import lease_cutoff


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


def _set(s: Session, model: type[Any], *where: Any, **values: Any) -> bool:
    result = cast(CursorResult[Any], s.execute(update(model).where(*where).values(**values)))
    return bool(result.rowcount)


def take_lease(
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


def renew_lease(
    s: Session, model: type[Any], row_id: object, column: str, token: object, new_token: object
) -> bool:
    """Replace the token of a lease still held under ``token``; False (nothing changed) if it was
    taken over or released meanwhile."""
    return _set(s, model, model.id == row_id, _column(model, column) == token, **{column: new_token})


def release_lease(
    s: Session, model: type[Any], row_id: object, column: str, token: object, **values: Any
) -> bool:
    """Give back a lease still held under ``token``, setting ``values`` with it; False (nothing
    changed) if it was taken over or released meanwhile."""
    return _set(s, model, model.id == row_id, _column(model, column) == token, **{column: None}, **values)
