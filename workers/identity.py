"""Who an engine worker is: a stable name for what it reports, a per-process token for what it holds.

The **name** is the Celery node name the worker runs under: ``freight worker --model M --name
engine-a@%h`` gives ``engine-a@<hostname>`` (Celery's %h, %n and %d expanded, as Celery itself
expands them), and without ``--name`` it is ``M@<hostname>``. It is the ``worker`` label of the
worker's engine samples, so the /metrics series, the console's worker table, the dispatcher's
throughput estimates and the worker's log lines carry on under the same name when the worker is
restarted (a ``host:pid`` name started a new series with every process).

A name is not a fence, though. A worker restarted under its old name runs while the units its dead
predecessor claimed are still marked with the predecessor's claims, until their lease runs out and
the dispatcher queues them again; the new process must not mistake them for its own. So each
process draws an **incarnation** (its pid and a random part: pids repeat, in containers often
exactly), and every claim token is ``<name>:<incarnation>:<nonce>``. A worker's writes are fenced on
the whole token (``workers.unit_claims.held``) or on its own ``<name>:<incarnation>`` holder id
(``workers.task_policy.fail_pack``), never on the name alone.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

SEP = ":"  # between the parts of a claim token; a name may hold it too (parsed from the right)


def node_name(name: str | None, model: str, hostname: str | None = None) -> str:
    """The node name Celery gives a worker started with ``-n name`` (``model@%h`` when no name is
    given): Celery's own defaulting and %-expansion, so the label and Celery's name are one.
    ``hostname``: the host %h stands for (this machine's when None)."""
    from celery.utils.nodenames import default_nodename, host_format

    return host_format(default_nodename(name or f"{model}@%h"), host=hostname)


def new_incarnation() -> str:
    """This process's incarnation: ``<pid>-<8 hex digits>``, drawn once per engine worker."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def holder_id(worker: str, incarnation: str) -> str:
    """One worker process: ``<name>:<incarnation>``, what each of its claim tokens starts with."""
    return f"{worker}{SEP}{incarnation}"


def claim_token(holder: str) -> str:
    """A fresh claim token of the process ``holder`` (``holder_id``); the nonce tells its claims
    apart."""
    return f"{holder}{SEP}{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Holder:
    """Whose a claim token is."""

    worker: str  # the stable name: the `worker` label
    incarnation: str  # the process

    @property
    def pid(self) -> int | None:
        """The process id the incarnation names (None for a token of another shape)."""
        pid = self.incarnation.partition("-")[0]
        return int(pid) if pid.isdigit() else None


def holder_of(token: str | None) -> Holder | None:
    """The worker name and incarnation of a claim token; None for no token or one without both."""
    parts = (token or "").rsplit(SEP, 2)
    if len(parts) != 3 or not parts[0]:
        return None
    return Holder(parts[0], parts[1])
