"""The one exception policy of the Celery tasks (``workers.tasks``).

A task that raises either met an outage or a fault. An outage (the database unreachable, the
broker unreachable, the object store not answering) passes: the task is sent again with an
exponential backoff, a bounded number of times; past that the leases take over (a validation's or
a finalizer's lease runs out and the dispatcher's tick sends the task again, a unit's lease
redelivers it). A fault (anything else) would fail the same way on every delivery, so it ends the
work: the batch fails with an error naming the step, through the transitions the batch state
machine allows, and is never left ``validating``. Periodic tasks only log: the next period runs them
again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery import Task
from celery.exceptions import Retry
from sqlalchemy import update

from storage.broker import BROKER_ERRORS
from storage.db import is_transient as db_transient
from storage.lifecycle import NO_LIVE_COUNTS, finish_batch, move_units
from storage.models import Batch, UnitStatus, WorkUnit
from storage.objectstore import ObjectChanged, ObjectNotFound, ObjectStoreError
from storage.objectstore_retry import transient as store_call_transient
from storage.leases import FINALIZER_LEASE, VALIDATION_LEASE
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers.identity import SEP

log = logging.getLogger(__name__)

MAX_RETRIES = 8  # 5 s doubling to the cap: about 20 minutes of outage before the leases take over
RETRY_BASE_SECONDS = 5.0
RETRY_CAP_SECONDS = 300.0

F = TypeVar("F", bound=Callable[..., Any])
# (error naming the step, the task's arguments): end the work of a task that failed for good
OnFault = Callable[..., object]
# (when the retry is due, epoch seconds; the task's arguments): note it where the tick can see it
OnRetry = Callable[..., object]


def is_transient(exc: BaseException) -> bool:
    """An outage that a later delivery of the same task may not meet."""
    if isinstance(exc, BROKER_ERRORS) or db_transient(exc):
        return True
    if isinstance(exc, ObjectStoreError) and not isinstance(exc, ObjectNotFound | ObjectChanged):
        cause = exc.__cause__
        # the store wraps what boto3 raised: no connection, a timeout or a 5xx passes; a refusal
        # (access denied, no such bucket, no credentials) does not
        return (
            cause is None or isinstance(cause, TimeoutError | ConnectionError) or store_call_transient(cause)
        )
    return False


def retry_countdown(retries: int) -> float:
    """Seconds before the ``retries``-th retry (0-based): 5, 10, 20, … up to five minutes."""
    return min(RETRY_CAP_SECONDS, RETRY_BASE_SECONDS * 2**retries)


def describe(step: str, exc: BaseException) -> str:
    return f"internal error in step {step}: {type(exc).__name__}: {exc}"[:1000]


def guarded(on_fault: OnFault | None = None, on_retry: OnRetry | None = None) -> Callable[[F], F]:
    """Wrap a bound task (``bind=True``; its arguments are ids) in the policy: an outage retries
    it (``on_retry(due, *args)`` first records when the retry is due), a fault calls
    ``on_fault(error, *args)`` and ends the task."""

    def wrap(fn: F) -> F:
        step = fn.__name__

        @functools.wraps(fn)
        def run(self: Task, *args: Any) -> Any:
            try:
                return fn(self, *args)
            except Retry:
                raise
            except Exception as exc:
                if is_transient(exc):
                    _retry(self, step, args, exc, on_retry)
                    return None
                log.exception("task %s%r failed: %s", step, args, describe(step, exc))
                if on_fault is not None:
                    _end(self, step, args, exc, on_fault)
                return None

        return run  # type: ignore[return-value]

    return wrap


def periodic(fn: F) -> F:
    """A periodic task's policy: log whatever it raised; the next period runs it again."""
    step = fn.__name__

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            log.warning("periodic task %s failed (%s); the next period runs it again", step, describe(step, exc),
                        exc_info=not is_transient(exc))  # fmt: skip
            return None

    return run  # type: ignore[return-value]


def _retry(task: Task, step: str, args: tuple, exc: Exception, on_retry: OnRetry | None = None) -> None:
    retries = task.request.retries or 0
    if retries >= (task.max_retries if task.max_retries is not None else MAX_RETRIES):
        log.error("task %s%r: still failing after %d retries, leaving it to its lease: %s",
                  step, args, retries, describe(step, exc))  # fmt: skip
        return
    countdown = retry_countdown(retries)
    log.warning("task %s%r: %s; retry %d in %.0fs", step, args, describe(step, exc), retries + 1, countdown)
    if on_retry is not None:
        try:
            on_retry(time.time() + countdown, *args)
        except Exception as second:  # the database may be what is down: the lease decides instead
            log.warning("task %s%r: could not note when its retry is due: %s", step, args, second)
    raise task.retry(exc=exc, countdown=countdown, max_retries=None)


def _end(task: Task, step: str, args: tuple, exc: Exception, on_fault: OnFault) -> None:
    try:
        on_fault(describe(step, exc), *args)
    except Exception as second:
        if is_transient(second):  # could not record the failure: try the whole task again later
            _retry(task, step, args, second)
        else:
            log.exception("task %s%r: recording its failure failed too", step, args)


# -- what a fault ends, per task -----------------------------------------------------------------


def one_error(message: str, code: str = "internal_error") -> dict[str, Any]:
    """An error list of one error about the whole file (not a line), in the shape a failed
    validation records a batch's errors; estimates record theirs in it too."""
    return {
        "object": "list",
        "data": [{"code": code, "message": message, "param": None, "line": None}],
    }


def fail_validation(rt: Runtime, error: str, batch_id: str) -> bool:
    """``validating`` -> ``failed``, the error naming the step; False if it was not validating."""
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return False
        batch.errors = one_error(f"validation failed: {error}")
        batch.request_total = 0
        VALIDATION_LEASE.revoke(s, [batch_id])
        finish_batch(s, batch, BatchStatus.FAILED, int(time.time()))
    log.error("batch %s failed: validation failed: %s", batch_id, error)
    return True


def validation_retry_due(rt: Runtime, due: float, batch_id: str) -> None:
    """A validation retry is scheduled for ``due``: the tick waits a lease past it before it sends
    a copy of its own (``dispatcher.resend_lost_validations``)."""
    with rt.db.write() as s:
        s.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status == BatchStatus.VALIDATING)
            .values(validation_due_at=due)
        )


def fail_finalization(rt: Runtime, error: str, batch_id: str) -> bool:
    """``finalizing`` -> ``failed`` with the error; a ``cancelling`` batch can only become
    ``cancelled``, so it keeps its state and the error, and its finalizer lease is given back so the
    tick tries again. False if the batch was not failed."""
    message = f"finalization failed: {error}"
    with rt.db.write() as s:
        batch = s.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status not in (BatchStatus.FINALIZING, BatchStatus.CANCELLING):
            return False
        batch.errors = one_error(message)
        FINALIZER_LEASE.revoke(s, [batch_id])
        if batch.status == BatchStatus.CANCELLING:
            log.error("batch %s (cancelling): %s", batch_id, message)
            return False
        finish_batch(s, batch, BatchStatus.FAILED, int(time.time()))
    log.error("batch %s failed: %s", batch_id, message)
    return True


def fail_pack(
    rt: Runtime, holder: str, engine_failed: bool, error: str, pack_id: str, unit_ids: list[int]
) -> int:
    """The units of the pack this worker process (``holder``: workers/identity.holder_id) claimed
    -> ``failed`` (their requests become error lines); their batches then finish through
    ``finalizing``, the only way out of ``in_progress``. Units another worker runs, or not yet
    claimed, are left alone, and so are those a dead predecessor of the same name still holds
    (a redelivered pack): the incarnation in the holder tells them apart. Nothing when the engine
    died: that is the worker's fault, not the pack's, and its units were given back. Returns the
    units failed."""
    if engine_failed:
        return 0
    with rt.db.write() as s:
        failed = move_units(
            s,
            WorkUnit.id.in_(unit_ids),
            WorkUnit.pack_id == pack_id,
            WorkUnit.worker.startswith(holder + SEP, autoescape=True),  # a name may hold % or _
            from_=UnitStatus.RUNNING,
            to=UnitStatus.FAILED,
            finished_at=time.time(),
            **NO_LIVE_COUNTS,
            note=f"pack failed: {error}",
        )
    log.error("pack %s: %d unit(s) failed: %s", pack_id, failed, error)
    return failed
