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
