"""The `freight` commands keep FREIGHT_DATA_DIR their owner's alone (issue #19, section 9): run as
an operator runs them (a subprocess, under the usual umask 022), the data folder they create is
0700 and the database and everything else in it 0600."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from tests.conftest import REPO
from tests.factories import run_freight


def freight(*argv: str, data_dir: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FREIGHT_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(REPO),
    }
    env.pop("FREIGHT_DATABASE_URL", None)
    env.pop("FREIGHT_OBJECT_STORE_URL", None)
    return run_freight(*argv, env=env, cwd=REPO, umask=0o022)


def test_the_data_folder_and_its_files_are_private(tmp_path: Path) -> None:
    data = tmp_path / "state" / "data"
    for argv in (["db", "upgrade"], ["tenant", "create", "alpha"]):
        done = freight(*argv, data_dir=data)
        assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    made = sorted(data.rglob("*"))
    assert data / "freight.db" in made
    modes = {p.relative_to(data).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in made}
    assert modes == {name: 0o700 if (data / name).is_dir() else 0o600 for name in modes}


def test_a_tenant_name_a_spreadsheet_would_run_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert freight("db", "upgrade", data_dir=data).returncode == 0
    done = freight("tenant", "create", '=HYPERLINK("http://x")', data_dir=data)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "tenant name must be 1 to 64 letters, digits" in done.stderr
