"""Freight's local state is its owner's alone (issue #19, section 9): folders 0700, files 0600,
even for a process whose umask would leave them readable by everyone (022, the usual default)."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from storage.db import Database
from storage.objectstore import LocalObjectStore
from storage.private_files import create_private_file, make_private_dir, private_process


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The process umask at 022 for the test (a file made without a mode is then 0644)."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_every_folder_made_is_private_and_existing_ones_are_left(tmp_path: Path, open_umask: None) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    made = make_private_dir(shared / "a" / "b" / "c")
    assert made.is_dir()
    assert [mode(shared / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    assert mode(shared) == 0o755  # it existed: not Freight's to change
    make_private_dir(made)  # again: nothing to do
    create_private_file(made / "f")
    assert mode(made / "f") == 0o600
    (made / "f").write_text("kept")
    create_private_file(made / "f")  # existing: untouched
    assert (made / "f").read_text() == "kept"


def test_the_sqlite_database_and_its_journal_are_private(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "data" / "db" / "freight.db"
    db = Database(f"sqlite:///{path}")
    try:
        with db.write() as s:
            s.execute(text("CREATE TABLE t (x INTEGER)"))
            s.execute(text("INSERT INTO t VALUES (1)"))
        files = sorted(p.name for p in path.parent.iterdir())
        assert "freight.db" in files and "freight.db-wal" in files  # WAL mode: the journal is a file
        assert {name: mode(path.parent / name) for name in files} == dict.fromkeys(files, 0o600)
        assert mode(path.parent) == mode(path.parent.parent) == 0o700
    finally:
        db.dispose()


def test_local_objects_are_private(tmp_path: Path, open_umask: None) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    store.put_stream("files/ab/file-1", io.BytesIO(b"a tenant's prompts"))
    assert mode(tmp_path / "objects" / "files" / "ab" / "file-1") == 0o600
    assert [mode(tmp_path / "objects" / p) for p in ("", "files", "files/ab")] == [0o700] * 3
    store.copy("files/ab/file-1", "results/x")
    assert mode(tmp_path / "objects" / "results" / "x") == 0o600


def test_a_server_process_makes_its_data_folder_private_and_its_umask_077(
    tmp_path: Path, open_umask: None, caplog: pytest.LogCaptureFixture
) -> None:
    private_process(tmp_path / "new" / "data")
    try:
        assert mode(tmp_path / "new" / "data") == mode(tmp_path / "new") == 0o700
        assert os.umask(0o077) == 0o077  # what a later open() or spawned process gets
        (tmp_path / "new" / "data" / "plain").write_text("x")  # no mode given: the umask's
        assert mode(tmp_path / "new" / "data" / "plain") == 0o600
        assert "chmod 700" not in caplog.text
        open_dir = tmp_path / "open"
        open_dir.mkdir()
        open_dir.chmod(0o755)  # an operator's folder, open to others
        private_process(open_dir)
        assert mode(open_dir) == 0o755 and "chmod 700" in caplog.text  # reported, not changed
    finally:
        os.umask(0o022)
