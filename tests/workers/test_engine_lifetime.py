"""The engine-lifetime plugin, on real processes: a child that ran it dies when its parent is
SIGKILLed; one that did not outlives it (which is what vLLM's engine core does on its own); and a
real engine whose core runs in processes of its own (FREIGHT_ENGINE_CORE=process) goes with its
killed worker."""

from __future__ import annotations

import contextlib
import ctypes
import logging
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

from workers.engine_lifetime import PARENT_ENV, START_ERROR_ENV, die_with_worker

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


# a worker with a real engine; prints "ready" once it is up
ENGINE_WORKER = textwrap.dedent(
    """
    import os, time
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from workers.engine import Engine, EngineConfig
    Engine.start(EngineConfig(model_path={model!r}, served_name="demo", max_num_seqs=4,
                              kv_cache_bytes=16 * 1024 * 1024, enforce_eager=True, core={core!r}))
    print("ready", flush=True)
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


def _death_signal() -> int:
    """This process's parent-death signal (prctl PR_GET_PDEATHSIG): 0 when none is asked for."""
    value = ctypes.c_int(-1)
    assert ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(value), 0, 0, 0) == 0
    return value.value


def test_outside_an_engine_core_the_plugin_does_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only vLLM's engine core, spawned by the worker named, asks for a death signal and records
    start failures: not a process without a worker named, nor the worker itself, nor a process
    whose parent is named but that vLLM did not spawn (pytest's own)."""
    assert _death_signal() == 0
    monkeypatch.setenv(START_ERROR_ENV, str(tmp_path / "start-error"))
    vllm_logger = logging.getLogger("vllm")
    handlers = list(vllm_logger.handlers)
    monkeypatch.delenv(PARENT_ENV, raising=False)
    die_with_worker()  # no worker named: not a Freight engine
    for named in (str(os.getpid()), str(os.getppid()), "not a pid"):
        monkeypatch.setenv(PARENT_ENV, named)
        die_with_worker()
    try:
        assert _death_signal() == 0
        assert vllm_logger.handlers == handlers
    finally:  # a failed check must not leave pytest's process killed with its parent
        ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)
        vllm_logger.handlers[:] = handlers


def test_vllm_finds_the_plugin() -> None:
    values = [e.value for e in entry_points(group="vllm.general_plugins")]
    assert "workers.engine_lifetime:die_with_worker" in values


def test_a_killed_workers_engine_processes_exit_with_it(demo_model_dir: Path) -> None:
    """SIGKILL to the worker alone (the OOM killer, ``kill -9 PID``): vLLM's engine core and its
    model worker exit too, rather than keep the engine's memory from the worker replacing it. (The
    live stack's workers run their core inline, where nothing outlives the worker's process.)"""
    worker = subprocess.Popen(
        [sys.executable, "-c", ENGINE_WORKER.format(model=str(demo_model_dir), core="process")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    engine: list[psutil.Process] = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:  # vLLM logs to stdout too
            if line.strip() == "ready":
                break
        assert worker.poll() is None, "the engine did not start"
        engine = [
            p for p in psutil.Process(worker.pid).children(recursive=True) if p.name().startswith("VLLM::")
        ]
        assert len(engine) >= 2, engine  # the engine core and at least one model worker
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        _, alive = psutil.wait_procs(engine, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        worker.kill()
        for p in engine:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
