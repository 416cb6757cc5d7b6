"""storage/tick_clock.py's table comes and goes with migration 0035, on SQLite and PostgreSQL
(what the tick writes is tested in tests/workers/test_dispatcher.py)."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect

from storage import tick_clock
from storage.migrate import alembic_config, check, upgrade


def test_migration_0035_goes_down_and_up(runtime, settings) -> None:
    with runtime.db.write() as s:
        tick_clock.record_tick(s, 1_000.5)
    with runtime.db.read() as s:
        assert tick_clock.last_tick(s) == 1_000.5
    runtime.db.dispose()
    command.downgrade(alembic_config(settings.database_url), "0034")
    assert "dispatcher_ticks" not in inspect(runtime.db.engine).get_table_names()
    upgrade(settings.database_url)
    check(settings.database_url)  # the table matches the model again
    with runtime.db.read() as s:
        assert tick_clock.last_tick(s) is None
