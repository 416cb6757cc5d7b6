"""Freight's local state is its owner's alone: folders 0700, files 0600.

The data folder (FREIGHT_DATA_DIR) holds the SQLite database (API key digests, drop-folder
credentials), the local object store (every tenant's prompts and results), the console's session
key and, after `make run`, the demo API key. A default umask (022) would leave all of it readable
by every user of the machine. So the server commands set the umask 077, which every process they
exec or spawn inherits (gunicorn, Celery, vLLM's engine processes), and the writers that make
the database and objects also pass the modes themselves, for callers that never went through a
command (the stack started in-process, tests, the benchmark).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
UMASK = 0o077  # what the server commands run under: no group or other bits on anything new


def make_private_dir(path: Path) -> Path:
    """``mkdir -p`` whose every folder it creates is 0700 (``Path.mkdir(parents=True)`` gives
    the parents the default mode). Folders that exist are left as they are."""
    path = Path(path)
    missing: list[Path] = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(folder, DIR_MODE)
    return path


def create_private_file(path: Path) -> None:
    """Make ``path`` empty with mode 0600 unless it exists (then it is left untouched)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))


def open_private(path: Path) -> int:
    """A new file (it must not exist) for writing, mode 0600: a file descriptor."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)


def private_process(data_dir: Path) -> None:
    """For a server command, before it touches anything: umask 077, and the data folder made 0700.
    A data folder that already exists open to others is not changed (it may be a folder the
    operator shares on purpose), only reported."""
    os.umask(UMASK)
    make_private_dir(data_dir)
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if mode & 0o077:
        log.warning(
            "FREIGHT_DATA_DIR %s is mode %o: other users of this machine may read Freight's database "
            "and objects; chmod 700 it",
            data_dir,
            mode,
        )
