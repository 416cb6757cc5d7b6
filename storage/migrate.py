"""Schema changes only through Alembic: upgrade to head, and check models match the migrations."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from storage.db import Database

ALEMBIC_INI = Path(__file__).resolve().parent.parent / "migrations" / "alembic.ini"


def alembic_config(database_url: str) -> Config:
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    db = Database(database_url)  # same engine set-up as the app: SQLite folder, WAL, pragmas
    try:
        with db.engine.begin() as connection:
            config = alembic_config(database_url)
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
    finally:
        db.dispose()


def check(database_url: str) -> None:
    """Raises if the models hold changes no migration describes (what CI's `alembic check` does)."""
    command.check(alembic_config(database_url))


def schema_state(database_url: str) -> str | None:
    """None when the database is at the newest migration; else what is wrong with it, in words a
    command can print (no schema at all, or an older or unknown revision). Connection failures
    raise (sqlalchemy's OperationalError), for the caller to report as such."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    db = Database(database_url)
    try:
        with db.engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    finally:
        db.dispose()
    if current == head:
        return None
    if current is None:
        return "has no Freight schema (it was never migrated)"
    return f"is at schema revision {current}, not the newest ({head})"
