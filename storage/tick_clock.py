"""When the dispatcher's tick last completed: written by each tick, read by ``/metrics``.

One row (``dispatcher_ticks``, name ``tick``). Ticks may run concurrently (the periodic task and
the refills after events), so the write keeps the latest time: a slow tick finishing after a
faster later one never moves the clock back.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from storage.models import DispatcherTick

TICK = "tick"


def record_tick(s: Session, completed_at: float) -> None:
    if s.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    statement = insert(DispatcherTick).values(name=TICK, completed_at=completed_at)
    s.execute(
        statement.on_conflict_do_update(
            index_elements=["name"],
            set_={"completed_at": statement.excluded.completed_at},
            where=DispatcherTick.completed_at < statement.excluded.completed_at,
        )
    )


def last_tick(s: Session) -> float | None:
    """Epoch seconds of the latest completed tick; None before the first."""
    return s.scalar(select(DispatcherTick.completed_at).where(DispatcherTick.name == TICK))
