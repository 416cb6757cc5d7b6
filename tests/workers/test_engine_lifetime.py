"""The engine-lifetime plugin, on real processes: a child that ran it dies when its parent is
SIGKILLed; one that did not outlives it (which is what vLLM's engine core does on its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path

import psutil
import pytest

from workers.engine_lifetime import PARENT_ENV, die_with_worker

REPO = Path(__file__).resolve().parents[2]

# the "worker": names itself in the environment as Engine.start does, spawns a child as vLLM
# spawns its engine core, prints the child's pid and waits to be killed
WORKER = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    os.environ[{env!r}] = str(os.getpid())
    from tests.workers.test_engine_lifetime import hold
    child = multiprocessing.get_context("spawn").Process(target=hold, args=({plugin}, {ready!r}))
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def hold(run_plugin: bool, ready: str) -> None:
    """The engine core's stand-in: load the plugin (or not), say so, then live as long as allowed."""
    if run_plugin:
        die_with_worker()
    Path(ready).touch()
    time.sleep(600)


def orphan_after_kill(run_plugin: bool, tmp_path: Path, grace: float) -> psutil.Process | None:
    """Start a worker and its child, SIGKILL the worker alone; the child if it is still alive
    ``grace`` seconds later."""
    ready = tmp_path / "child-ready"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER.format(env=PARENT_ENV, plugin=run_plugin, ready=str(ready))],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert worker.stdout is not None
    child = psutil.Process(int(worker.stdout.readline()))
    deadline = time.monotonic() + 30
    while not ready.exists():  # the child has imported and run the plugin (or not)
        assert child.is_running() and time.monotonic() < deadline
        time.sleep(0.02)
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    _, alive = psutil.wait_procs([child], timeout=grace)
    return alive[0] if alive else None


def test_the_child_dies_with_its_killed_parent(tmp_path: Path) -> None:
    assert orphan_after_kill(run_plugin=True, tmp_path=tmp_path, grace=10) is None


def test_without_the_plugin_the_child_outlives_its_parent(tmp_path: Path) -> None:
    orphan = orphan_after_kill(run_plugin=False, tmp_path=tmp_path, grace=2)  # the other dies in ms
    try:
        assert orphan is not None  # the failure the plugin exists for
    finally:
        if orphan is not None:
            orphan.kill()


def test_outside_an_engine_core_the_plugin_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PARENT_ENV, raising=False)
    die_with_worker()  # no worker named: not a Freight engine
    monkeypatch.setenv(PARENT_ENV, str(os.getpid()))
    die_with_worker()  # the worker itself
    monkeypatch.setenv(PARENT_ENV, "not a pid")
    die_with_worker()
    assert psutil.Process().is_running()


def test_vllm_finds_the_plugin() -> None:
    values = [e.value for e in entry_points(group="vllm.general_plugins")]
    assert "workers.engine_lifetime:die_with_worker" in values
