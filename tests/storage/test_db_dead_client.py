"""A database client on a host that vanishes mid-transaction gives its row locks back within
seconds (``storage.db.DEAD_CLIENT_SETTINGS``), rather than after TCP keepalive's two hours.

Found by the multi-host test (tests/e2e/test_multi_host.py): an engine host cut off while inside a
transaction left its PostgreSQL session idle in that transaction, holding the locks of its units,
and the dispatcher's redelivery of those units waited on them. Here the same on real components:
PostgreSQL on one namespace host, a client holding a row lock on another, that host's link cut.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import text

from infra import daemons as services
from infra.netns import Network, check_available
from storage.db import DEAD_CLIENT_SETTINGS, Database

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 25  # keepalive idle 5 s + 3 probes 2 s apart = 11 s, and slack for a loaded machine
HOLDER = """
import sys, time
from sqlalchemy import text
from storage.db import Database
db = Database(sys.argv[1])
with db.write() as s:
    s.execute(text("SELECT v FROM t WHERE id = 1 FOR UPDATE"))
    print("locked", flush=True)
    time.sleep(600)  # the host is cut off meanwhile: this transaction never ends by itself
"""


def test_a_cut_off_clients_row_locks_are_released_within_seconds(tmp_path: Path) -> None:
    check_available()
    net = Network.create({"db": tmp_path / "db", "client": tmp_path / "client"}, peers={"client": ("db",)})
    holder: subprocess.Popen[str] | None = None
    database: Database | None = None
    try:
        host = net.hosts["db"]
        pg = services.start_postgres(host.folder, 5432, host=host.address, prefix=host.prefix)
        database = Database(pg.url)
        with database.write() as s:
            s.execute(text("CREATE TABLE t (id integer PRIMARY KEY, v integer)"))
            s.execute(text("INSERT INTO t VALUES (1, 0)"))
            # the session settings took (a unix socket would show 0 for the tcp ones)
            assert s.scalar(text("SHOW tcp_keepalives_idle")) == DEAD_CLIENT_SETTINGS["tcp_keepalives_idle"]
        holder = subprocess.Popen(
            [*net.hosts["client"].prefix, sys.executable, "-c", HOLDER, pg.url],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        net.cut("client")
        cut = time.monotonic()
        with database.write() as s:
            s.execute(text(f"SET LOCAL lock_timeout = '{BOUND_S * 2}s'"))  # fails rather than hangs
            s.execute(text("UPDATE t SET v = 1 WHERE id = 1"))
        released_s = time.monotonic() - cut
        print(f"the cut client's lock was released {released_s:.1f} s after the cut")
        assert released_s < BOUND_S
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        if database is not None:
            database.dispose()
        services.stop_all(tmp_path / "db")
        assert net.remove() == []
