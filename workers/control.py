"""The control worker: a small supervisor of one Celery worker process per role.

The control plane's work is split by role, each with its own queue (``storage.broker.CONTROL_ROLES``)
and its own process pool, so that one tenant's fifty large uploads fill the validation pool only:
the dispatcher tick and finalization keep running beside them.

- ``tick``: the periodic tasks (the dispatcher tick, cleanup, drop-folder polls), 2 processes;
- ``finalize``: finalization and the drop folders' scans and deliveries,
  FREIGHT_FINALIZE_CONCURRENCY processes;
- ``validate``: validation (with the queue of releases before the roles, ``freight.control``),
  FREIGHT_VALIDATION_CONCURRENCY processes; only this role loads vLLM's request models and the
  served models' tokenizers;
- ``webhook``: webhook deliveries, FREIGHT_WEBHOOK_CONCURRENCY threads (each attempt is a network
  call bounded by FREIGHT_WEBHOOK_TIMEOUT_SECONDS, so threads, not processes, wait on receivers).

Every role but ``webhook`` runs Celery's prefork pool, the pool that enforces the tasks' time
limits; an attempt bounds its own time (``workers.webhooks``).

``freight worker --control`` runs this supervisor: it starts ``python -m workers.bootstrap worker
--control --role ROLE`` for each role, logs ``<name> ready.`` once every role is ready (what
``infra.processes`` waits for), turns SIGTERM and SIGINT into a warm shutdown of every role, and
starts a role that exits on its own again, leaving the others and their tasks alone: a role's
Celery worker can die of a fault that passes (kombu's Redis client failed on a reconnect with a
task in flight: ``AttributeError`` in ``restore_unacked``, and the tick role was gone for good
with the stack still up). A role that keeps exiting (FREIGHT_CONTROL_ROLE_RESTARTS in
FREIGHT_CONTROL_ROLE_RESTART_WINDOW_SECONDS) makes the supervisor stop the others and exit 1, for
the process manager. ``freight worker --control --role ROLE`` runs one role alone, for
deployments that scale the roles apart; its process manager restarts it (exit status 1 after
Celery's "Unrecoverable error", ``workers.bootstrap.run_then_exit``).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from types import FrameType

log = logging.getLogger(__name__)

ROLES = ("tick", "finalize", "validate", "webhook")
# the descriptor a supervised role writes a line to once it is ready (and its ready line is left out)
READY_FD_ENV = "FREIGHT_CONTROL_READY_FD"
TICK_CONCURRENCY = 2  # the tick beside a long cleanup pass or drop-folder poll
MAX_RESTART_DELAY = 30.0  # seconds before a role that keeps exiting is started again, at most


def role_name(name: str | None, role: str) -> str:
    """The Celery node name of a role: ``control-validate@%h``, or the given name with the role."""
    if not name:
        return f"control-{role}@%h"
    node, at, host = name.partition("@")
    return f"{node}-{role}@{host}" if at else f"{name}-{role}"


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere
    nothing). A role and its pool processes must not outlive the supervisor: ``make stop`` gives it
    a warm shutdown, then SIGKILLs it, and only its own process group, which the roles are not in."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RestartBudget:
    """When a role that exited on its own starts again: after a delay doubling from 1 s (at most
    ``MAX_RESTART_DELAY``) with its restarts inside the window, and not at all once it has been
    restarted ``limit`` times within ``window`` seconds. A role that dies of a passing fault (the
    broker's client failing on a reconnect, say) is back in a second without disturbing the
    others' tasks; one that dies at once on every start neither spins nor hides: the supervisor
    gives up and exits 1, and the process manager takes over."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self._restarts: dict[str, list[float]] = {}  # role -> its restarts' times in the window

    def next_start(self, role: str, now: float) -> float | None:
        """When to start ``role`` again, having exited at ``now``; None: its budget is spent."""
        recent = [t for t in self._restarts.get(role, []) if t > now - self.window]
        if len(recent) >= self.limit:
            return None
        recent.append(now)
        self._restarts[role] = recent
        return now + min(2.0 ** (len(recent) - 1), MAX_RESTART_DELAY)

    def used(self, role: str) -> int:
        return len(self._restarts.get(role, []))


def supervise(
    name: str | None = None,
    roles: tuple[str, ...] = ROLES,
    restarts: int = 5,
    restart_window: float = 600.0,
) -> int:
    """Run every role, each in its own process, restarting one that exits on its own within
    ``RestartBudget(restarts, restart_window)``; returns the exit status (1: a role's budget ran
    out, and every other role was stopped)."""
    return _Supervisor(name, roles, restarts, restart_window).run()


class _Supervisor:
    """One `supervise` run: the roles' processes, their ready pipes and their restarts."""

    def __init__(
        self, name: str | None, roles: tuple[str, ...], restarts: int, restart_window: float
    ) -> None:
        self.name, self.roles = name, roles
        self.restarts, self.restart_window = restarts, restart_window
        self.children: dict[str, subprocess.Popen] = {}  # the roles running (or exiting) now
        self.pending: dict[int, str] = {}  # read end of a role's ready pipe -> role
        self.restart_at: dict[str, float] = {}  # roles waiting to start again -> when (monotonic)
        self.budget = RestartBudget(restarts, restart_window)
        self.stopping = False
        self.ready: set[str] = set()
        self.all_ready = False
        self.status = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        for role in self.roles:
            self.start(role)
        while True:
            if self.pending:
                self.read_ready()
            else:
                time.sleep(0.5)
            children = self.children
            exited = {role: child.returncode for role, child in children.items() if child.poll() is not None}
            if self.stopping:
                if len(exited) == len(children):
                    break
                continue
            now = time.monotonic()
            self.schedule_restarts(exited, now)
            self.start_due(now)
        for fd in self.pending:
            os.close(fd)
        return self.status

    def stop_all(self) -> None:
        self.stopping = True
        self.restart_at.clear()
        for child in self.children.values():
            if child.poll() is None:
                # SIGTERM even for SIGINT: a second SIGINT would make Celery's shutdown a cold one
                child.send_signal(signal.SIGTERM)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("control worker: %s, warm shutdown of every role", signal.Signals(signum).name)
        self.stop_all()

    def start(self, role: str) -> None:
        read_end, write_end = os.pipe()
        argv = [sys.executable, "-m", "workers.bootstrap", "worker", "--control", "--role", role]
        self.children[role] = subprocess.Popen(
            [*argv, *(["--name", self.name] if self.name else [])],
            env={**os.environ, READY_FD_ENV: str(write_end)},
            pass_fds=(write_end,),
            # its own process group: a signal to the supervisor's group (make stop) must not reach
            # the prefork pool processes directly (they die on SIGTERM, cutting their tasks short);
            # the supervisor forwards it to the role's main process, which shuts down warm
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        os.close(write_end)
        self.pending[read_end] = role

    def read_ready(self) -> None:
        """Wait up to 0.5 s for roles' ready lines; once every role is ready, say so once."""
        readable = select.select(list(self.pending), [], [], 0.5)[0]  # a signal: retried (PEP 475)
        for fd in readable:
            said = os.read(fd, 64)
            os.close(fd)
            role = self.pending.pop(fd)
            if said and not self.stopping:
                self.ready.add(role)
                log.info("control worker: role %s ready", role)
                # once: what infra.processes waits for
                if self.ready == set(self.roles) and not self.all_ready:
                    self.all_ready = True
                    log.info("%s ready.", self.name or f"control@{os.uname().nodename}")

    def schedule_restarts(self, exited: dict[str, int], now: float) -> None:
        """Each role that exited on its own starts again when its budget says; when a budget is
        spent, every role is stopped and the exit status is 1."""
        for role, code in exited.items():
            del self.children[role]
            self.ready.discard(role)
            when = self.budget.next_start(role, now)
            if when is None:
                log.error(
                    "control worker: role %s exited on its own (status %s) after %d restarts in %.0f s;"
                    " stopping the others",
                    role, code, self.restarts, self.restart_window,
                )  # fmt: skip
                self.status = 1
                self.stop_all()
                break
            log.error(
                "control worker: role %s exited on its own (status %s); starting it again in %.0f s"
                " (restart %d of at most %d in %.0f s)",
                role, code, when - now, self.budget.used(role), self.restarts, self.restart_window,
            )  # fmt: skip
            self.restart_at[role] = when

    def start_due(self, now: float) -> None:
        for role, when in list(self.restart_at.items()):
            if when <= now:
                del self.restart_at[role]
                self.start(role)


def supervised_ready(on_ready_fd: int) -> None:
    """In a role the supervisor started: tell it when Celery is ready, and leave Celery's own
    ``ready.`` line out of the shared log (the supervisor's says that every role is ready)."""
    from celery import signals

    class _NoReadyLine(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.msg == "%s ready.":
                record.msg = "%s up (a role of the control worker)"
            return True

    logging.getLogger("celery.apps.worker").addFilter(_NoReadyLine())

    @signals.worker_ready.connect(weak=False)
    def tell(**_: object) -> None:
        try:
            os.write(on_ready_fd, b"ready\n")
            os.close(on_ready_fd)
        except OSError:  # the supervisor is gone
            pass
