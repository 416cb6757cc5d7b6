"""Database engine and transactions.

Services open a transaction with ``db.write()`` when they change state and ``db.read()`` when they
only look. On SQLite a write transaction starts with ``BEGIN IMMEDIATE`` so two processes never
both read a row and then race to upgrade to a write lock (SQLite answers that race with "database
is locked" at once, without waiting); on PostgreSQL writers lock the rows they change with
``SELECT … FOR UPDATE``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Executable, create_engine, event, func, select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from storage.private_files import create_private_file, make_private_dir

_IMMEDIATE = "freight_sqlite_immediate"
# A client host that vanishes mid-transaction (power, network) keeps its row locks on the server
# until the server finds its connection dead: by default after TCP keepalive's two idle hours, and
# meanwhile the dispatcher's redelivery of that host's units waits on the locks. Each PostgreSQL
# session asks the server to probe an idle client after 5 s, every 2 s, and drop it after 3
# unanswered probes, and to drop one whose sent data stays unacknowledged for 10 s (ms): a dead
# host's locks go about 11 s after it fell silent (tests/storage/test_db_dead_client.py).
DEAD_CLIENT_SETTINGS = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


def is_transient(exc: BaseException) -> bool:
    """The database was unreachable or the connection was cut (a restart, a failover, a lock
    wait on SQLite): the same transaction may succeed if run again. Whether running it again is
    safe is the caller's to know (compare-and-set writes are)."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


class Database:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = _make_engine(url)
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(
            self.engine.execution_options(**{_IMMEDIATE: True}), expire_on_commit=False
        )
        # SQLite has one writer at a time; its busy handler makes a waiting writer sleep in steps
        # of up to 100 ms. Threads of one process queue on this lock instead and get the write
        # lock the moment it is free (other processes still meet the busy handler).
        self._write_turn = threading.RLock() if self.is_sqlite else nullcontext()

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._reader() as session, session.begin():
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction that commits on success and rolls back on any exception."""
        with self._write_turn, self._writer() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


def changed_rows(s: Session, statement: Executable) -> int:
    """Run an UPDATE or DELETE in ``s``; the rows it changed (what every compare-and-set reads)."""
    return int(cast(CursorResult[Any], s.execute(statement)).rowcount)


def transaction_lock(s: Session, name: str, wait: bool = True) -> bool:
    """Hold the lock ``name`` until ``s``'s transaction ends; ``wait=False``: only if no other
    transaction holds it (False then, and nothing is held). On PostgreSQL an advisory lock keyed
    by the name's hash; on SQLite always True, a write transaction being exclusive already.

    For work that must not run twice at once, as a whole: two transactions that lock overlapping
    rows in different orders deadlock, and PostgreSQL then fails one of them."""
    if s.get_bind().dialect.name != "postgresql":
        return True
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    if wait:
        s.execute(select(func.pg_advisory_xact_lock(key)))
        return True
    return bool(s.scalar(select(func.pg_try_advisory_xact_lock(key))))


def _make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        engine = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)
        if engine.dialect.name == "postgresql":

            @event.listens_for(engine, "connect")
            def _server_watches_client(dbapi_connection, _record):
                # SET, not a startup option: connection poolers refuse unknown startup options
                # one round trip: set_config(name, value, is_local=false) is SET as a function
                calls = ", ".join(
                    f"set_config('{name}', '{value}', false)" for name, value in DEAD_CLIENT_SETTINGS.items()
                )
                cursor = dbapi_connection.cursor()
                cursor.execute(f"SELECT {calls}")
                cursor.close()
                dbapi_connection.commit()

        return engine

    path = url.split("///", 1)[-1]
    if path and path != ":memory:":
        # the database is its owner's alone (storage/private_files.py); SQLite gives its -wal and
        # -shm files the database file's mode
        make_private_dir(Path(path).parent)
        if "///" in url and "?" not in path:  # a plain file path (not sqlite:// in memory, no options)
            create_private_file(Path(path))
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself, below
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        immediate = conn.get_execution_options().get(_IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine
