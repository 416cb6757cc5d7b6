"""Pause a warm system's processes while another system is measured, so it takes no CPU from it.

The interleaved runs of bench/scheduler.py keep the in-process engine and two Freight stacks warm
at once; on 2 cores an idle Freight stack still spends about 2 CPU-seconds a minute (beat, the
dispatcher's tick, vLLM's idle worker), which would bias whichever system is measured next to it.
SIGSTOP on every process of the tree stops that; SIGCONT resumes it. Only idle systems are paused
(nothing in flight), so no lease or heartbeat runs out while stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import psutil


def tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes with these pids and all their descendants (gone ones are skipped)."""
    out: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            out += [proc, *proc.children(recursive=True)]
    return out


def pause(pids: Iterable[int]) -> None:
    for proc in tree(pids):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.suspend()


def resume(pids: Iterable[int]) -> None:
    for proc in reversed(tree(pids)):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.resume()
