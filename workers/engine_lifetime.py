"""A vLLM plugin that makes a Freight worker's engine processes die with the worker.

This is for an engine core in a process of its own (FREIGHT_ENGINE_CORE=process, the default off
a CPU); an inline core is the worker's own process and dies with it. Such a core is a child
process, and it starts the model's worker processes. When the front end is killed outright (SIGKILL, the OOM killer, a supervisor's forced stop), the
core does not notice: it and its workers live on, holding the engine's memory (on a GPU, the
whole KV cache), and the restarted Freight worker cannot load its engine beside them (vLLM issue
#55510, open). vLLM's workers already exit when the core does (a death pipe); the core has no such
link to its parent.

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts, so Freight
registers `die_with_worker` there (pyproject.toml). `Engine.start` names the front end's pid in
FREIGHT_ENGINE_PARENT_PID; in the process whose parent that is (the engine core), the plugin asks
the kernel for SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG, Linux). Elsewhere it does
nothing. The kernel ties the signal to the thread that started the core, so `Engine.start` must
run on a thread that lives as long as the worker (the worker's main thread does). It needs the engine core to be spawned, not forked (a forked child inherits the loaded
plugins and never runs them): `Engine.start` asks for spawn, which vLLM uses on CPU anyway.

The same plugin tells the worker why its engine core could not start. vLLM's front end only says
"Engine core initialization failed. See root cause above": the cause (a model's engine arguments
the machine cannot honour, say) is logged by the core process alone. `Engine.start` names a file
in FREIGHT_ENGINE_START_ERROR_FILE; in the core, `record_start_failure` puts the first exception
vLLM logs there, as one ``Type: message`` line, while that file exists (`Engine.start` removes it
once the engine is up, or after reading it).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

PARENT_ENV = "FREIGHT_ENGINE_PARENT_PID"
START_ERROR_ENV = "FREIGHT_ENGINE_START_ERROR_FILE"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class _FirstError(logging.Handler):
    """Writes the first exception logged by vLLM into the worker's start-error file, if that file
    still exists (once the engine is up the worker has removed it, and nothing is written)."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.ERROR)
        self.path = path
        self.done = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.done or not record.exc_info or record.exc_info[1] is None:
            return
        self.done = True
        exc = record.exc_info[1]
        text = (str(exc).strip().splitlines() or [""])[0]
        line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        try:
            with open(self.path, "r+", encoding="utf-8") as f:  # never creates it
                if not f.read():
                    f.write(line[:1000])
        except OSError:
            pass


def record_start_failure() -> None:
    """In vLLM's engine core: see the module docstring."""
    path = os.environ.get(START_ERROR_ENV)
    if not path:
        return
    vllm_logger = logging.getLogger("vllm")
    if not any(isinstance(h, _FirstError) for h in vllm_logger.handlers):
        vllm_logger.addHandler(_FirstError(path))


def die_with_worker() -> None:
    """Entry point (``vllm.general_plugins``): see the module docstring; safe to call twice."""
    try:
        worker = int(os.environ.get(PARENT_ENV, ""))
    except ValueError:
        return
    if not sys.platform.startswith("linux") or os.getpid() == worker:
        return
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != worker:
        return  # not the engine core: vLLM's own workers follow the core through its death pipe
    record_start_failure()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != worker:  # the worker died before the request took effect
        os._exit(1)
