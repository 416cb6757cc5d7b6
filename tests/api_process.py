"""`freight api` as a real process (gunicorn, one worker) on a test's database, broker and store:
for the tests that read what only a process shows (its memory, a worker killed mid-answer, a
seccomp filter around it). One place starts it, so its environment and readiness check are the
same in every such test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from infra import daemons
from infra.processes import REPO, wait_for
from storage.settings import Settings


def api_env(settings: Settings, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an API process on ``settings``' data folder, database, broker and
    models (this process's own FREIGHT_* variables left out), plus ``extra``."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("FREIGHT_")},
        "PYTHONPATH": str(REPO),
        "FREIGHT_DATA_DIR": str(settings.data_dir),
        "FREIGHT_DATABASE_URL": settings.database_url,
        "FREIGHT_BROKER_URL": settings.broker_url,
        "FREIGHT_MODELS": ",".join(f"{name}={path}" for name, path in settings.models.items()),
        "FREIGHT_COMPLETION_WINDOWS": "24h,1h",
        **(extra or {}),
    }


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def api_process(
    env: Mapping[str, str], cwd: Path, *, wrapper: Sequence[str] = (), what: str = "freight api answering"
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``freight api`` (one gunicorn worker) started in ``cwd`` (where it finds a gunicorn.conf.py,
    and writes api.log) with ``env``, under ``wrapper`` if given: its base URL once /healthz
    answers, and the process (gunicorn's master); stopped with SIGTERM after."""
    port = daemons.free_port()
    log = cwd / "api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "api.cli", "api", "--port", str(port), "--workers", "1"],
            cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(base + "/healthz"), what, 60, proc, log)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
