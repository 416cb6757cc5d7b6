"""A vLLM plugin that makes a Freight worker's engine processes die with the worker.

vLLM runs its engine core in a child process, and the core starts the model's worker processes.
When the front end is killed outright (SIGKILL, the OOM killer, a supervisor's forced stop), the
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
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PARENT_ENV = "FREIGHT_ENGINE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != worker:  # the worker died before the request took effect
        os._exit(1)
