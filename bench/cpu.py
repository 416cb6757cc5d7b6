"""CPU seconds each part of a system spends during one measured run.

On two cores every CPU-second the control plane takes comes out of the engine's threads, and
vLLM's CPU kernels split each step over both cores, so a core taken away stalls the other at the
step's end too: the per-process figures say where a wall-time gap between two systems comes from.

A role is a named process and its descendants (an engine worker's vLLM engine core and its model
processes); ``split`` keeps a role's own process apart from its children (the Python front end of
an engine worker against the vLLM processes it started).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

import psutil

from bench.freeze import tree


def _seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def snapshot(roles: Mapping[str, int], split: tuple[str, ...] = ()) -> dict[str, float]:
    """CPU seconds so far per role (pid and descendants); roles in ``split`` give two entries,
    ``ROLE`` (the process itself) and ``ROLE/children``."""
    out: dict[str, float] = {}
    for role, pid in roles.items():
        own = children = 0.0
        for proc in tree([pid]):
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.pid == pid:
                    own += _seconds(proc)
                else:
                    children += _seconds(proc)
        if role in split:
            out[role] = own
            out[f"{role}/children"] = children
        else:
            out[role] = own + children
    return out


# the process title Celery gives each process of a control role: "[celeryd: control-validate@host:
# ForkPoolWorker-1]", "[celeryd: control-tick@host:MainProcess] -active- (...)"
CONTROL_ROLE_TITLE = re.compile(r"\bcontrol-([\w-]+)@")


def control_role_of(title: str) -> str:
    """The control role (tick, validate, finalize, webhook, ...) a process title names; the
    supervisor that starts them has none of its own."""
    found = CONTROL_ROLE_TITLE.search(title)
    return found.group(1) if found else "supervisor"


def control_roles(pid: int) -> dict[str, float]:
    """CPU seconds so far of each role of the control plane under ``pid`` (its supervisor): the
    role's main process and its pool processes together. On two cores the control plane's
    CPU is the engine's loss, and which role spends it (validating, finalizing, the tick, webhook
    deliveries) is what a cut has to aim at."""
    out: dict[str, float] = {}
    for proc in tree([pid]):
        with contextlib.suppress(psutil.NoSuchProcess):
            role = control_role_of(" ".join(proc.cmdline()))
            out[role] = out.get(role, 0.0) + _seconds(proc)
    return out


def spent(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds per role between two snapshots. Only live processes are counted: a process that
    exits between them (a restarted worker process) takes its CPU with it, so a role can read low,
    never high; one API reading of 0.0 in scheduler-paired-avx2.json (as committed in 209bded) is
    unexplained."""
    return {role: round(max(0.0, after[role] - before.get(role, 0.0)), 2) for role in after}


def machine_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle and iowait)."""
    import os
    from pathlib import Path

    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """CPU seconds spent during a run by processes outside the measured system and this benchmark
    process: another job on the machine. On two cores any such second comes out of the run, so
    a run with a large figure here measured the machine's neighbours, not the system."""

    def __init__(self) -> None:
        self._machine = machine_seconds()
        self._me = _seconds(psutil.Process())

    def seconds(self, measured: Mapping[str, float]) -> float:
        """``measured``: the run's CPU seconds by role (``spent``), each counted once."""
        machine = machine_seconds() - self._machine
        me = _seconds(psutil.Process()) - self._me
        return round(max(0.0, machine - me - sum(measured.values())), 2)
