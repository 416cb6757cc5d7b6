"""The one exception policy of the Celery tasks (``workers.tasks``).

A task that raises either met an outage or a fault. An outage (the database unreachable, the
broker unreachable, the object store not answering) passes: the task is sent again with an
exponential backoff, a bounded number of times; past that the leases take over (a validation's or
a finalizer's lease runs out and the dispatcher's tick sends the task again, a unit's lease
redelivers it). A fault (anything else) would fail the same way on every delivery, so it ends the
work: the batch fails with an error naming the step, through the transitions the batch state
machine allows, and is never left ``validating``. Periodic tasks only log: the next period runs them
again. A task past its soft time limit meets ``TaskTimeLimit``, a fault; one the hard limit killed
(its pool process stuck) is handled by ``killed`` as its fault would have been. ``with_policy``
wraps a task's body in all of it; ``workers.tasks`` declares the tasks and their fault handlers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from celery import Task
from celery.exceptions import Retry, SoftTimeLimitExceeded, TimeLimitExceeded
from sqlalchemy import event, update
from sqlalchemy.exc import OperationalError

from storage.broker import BROKER_ERRORS, TASKS
from storage.db import is_transient as db_transient
from storage.leases import FINALIZER_LEASE, VALIDATION_LEASE
from storage.lifecycle import NO_LIVE_COUNTS, fail_validating, finish_batch, move_units
from storage.logs import bound
from storage.models import Batch, UnitStatus, WorkUnit
from storage.objectstore import ObjectChanged, ObjectNotFound, ObjectStoreError
from storage.objectstore_retry import transient as store_call_transient
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers.identity import SEP

log = logging.getLogger(__name__)

MAX_RETRIES = 8  # 5 s doubling to the cap: about 20 minutes of outage before the leases take over
RETRY_BASE_SECONDS = 5.0
RETRY_CAP_SECONDS = 300.0

F = TypeVar("F", bound=Callable[..., Any])
# (the task, the runtime to record with, the error naming the step, the task's arguments): end
# the work of a task that failed for good. The runtime is the task's own, except for a task the
# hard limit killed: then one of the handler's own (``record_killed``)
OnFault = Callable[..., object]
# (the runtime, when the retry is due in epoch seconds, the task's arguments): note it where the
# tick can see it
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


def guarded(fn: F) -> F:
    """Wrap a bound task (its arguments are ids) in the policy: an outage retries it (the task's
    ``retry_noted(rt, due, *args)`` first records when the retry is due), a fault calls the
    task's ``fault(task, rt, error, *args)`` and ends the task."""
    step = fn.__name__

    @functools.wraps(fn)
    def run(self: Task, *args: Any) -> Any:
        try:
            return fn(self, *args)
        except Retry:
            raise
        except Exception as exc:
            if is_transient(exc):
                _retry(self, step, args, exc, getattr(self, "retry_noted", None))
                return None
            log.exception("task %s%r failed: %s", step, args, describe(step, exc))
            fault = getattr(self, "fault", None)
            if fault is not None:
                _end(self, step, args, exc, fault)
            return None

    return run  # type: ignore[return-value]


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
            on_retry(task.rt, time.time() + countdown, *args)
        except Exception as second:  # the database may be what is down: the lease decides instead
            log.warning("task %s%r: could not note when its retry is due: %s", step, args, second)
    raise task.retry(exc=exc, countdown=countdown, max_retries=None)


def _end(task: Task, step: str, args: tuple, exc: Exception, on_fault: OnFault) -> None:
    try:
        on_fault(task, task.rt, describe(step, exc), *args)
    except Exception as second:
        if is_transient(second):  # could not record the failure: try the whole task again later
            _retry(task, step, args, second)
        else:
            log.exception("task %s%r: recording its failure failed too", step, args)


# -- time limits, and tasks the hard limit killed ------------------------------------------------

# task -> (the Settings field of its soft limit in seconds, its FREIGHT_*_TIME_LIMIT_SECONDS word,
# a multiple of it); enforced by the control roles' prefork pools only
TIME_LIMITS: dict[str, tuple[str, str, float]] = {
    "freight.validate_batch": ("validation_time_limit_seconds", "VALIDATION", 1),
    "freight.validate_chunk": ("validation_time_limit_seconds", "VALIDATION", 1),
    "freight.estimate": ("validation_time_limit_seconds", "VALIDATION", 1),
    "freight.convert_file": ("validation_time_limit_seconds", "VALIDATION", 1),
    "freight.finalize_batch": ("finalize_time_limit_seconds", "FINALIZE", 1),
    "freight.scan_dropfolder": ("finalize_time_limit_seconds", "FINALIZE", 1),
    "freight.deliver_dropfolder_object": ("finalize_time_limit_seconds", "FINALIZE", 1),
    "freight.tick": ("tick_time_limit_seconds", "TICK", 1),
    "freight.scan_dropfolders": ("tick_time_limit_seconds", "TICK", 1),
    "freight.cleanup": ("tick_time_limit_seconds", "TICK", 10),  # what a long pass leaves, the next does
}
# the hard time limit's handler (``killed``): how long its write waits for a row lock (PostgreSQL),
# and how often, a second apart, it tries again once the killed process has let go of its rows
KILLED_LOCK_WAIT_MS = 2000
KILLED_RETRIES = 60
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout that ran out
SOFT_LIMIT_REPEAT_SECONDS = 0.2


class TaskTimeLimit(RuntimeError):
    """A task ran past its time limit (a fault to the exception policy: it would again)."""


def soft_limit(settings: Any, name: str) -> tuple[float, str] | None:
    """Task ``name``'s soft limit in seconds and the setting that gives it; None: it has none."""
    if name not in TIME_LIMITS:
        return None
    field, word, times = TIME_LIMITS[name]
    return getattr(settings, field) * times, f"FREIGHT_{word}_TIME_LIMIT_SECONDS"


def time_limit_options(settings: Any, name: str) -> dict[str, float]:
    """Past the soft limit the task meets ``TaskTimeLimit`` (the policy then ends it: a fault, or
    for a periodic task the next period); the hard limit, a grace later, kills the pool process
    if it did not stop."""
    limit = soft_limit(settings, name)
    if limit is None:
        return {}
    soft = limit[0]
    return {"soft_time_limit": soft, "time_limit": soft + max(10.0, soft / 10)}


@contextlib.contextmanager
def _persistent_soft_limit() -> Iterator[list[bool]]:
    """Celery raises SoftTimeLimitExceeded once, wherever the task happens to be; code that turns
    any exception of one line into that line's error (a request body vLLM's validators trip over)
    would swallow it. So once the soft limit is past it is raised again every 0.2 s until the task
    has stopped. Only in a pool process's main thread, where prefork runs tasks (and signals go).
    Yields ``[fired]``: True once the soft limit was reached, so whatever the task then raises (code
    that wraps any error of a step into its own, a tokenizer's load say) is the time limit's."""
    fired = [False]
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        yield fired
        return

    running = [True]  # a signal landing as the task ends raises nothing

    def again(signum: int, frame: object) -> None:
        if running[0]:
            raise SoftTimeLimitExceeded()

    def first(signum: int, frame: object) -> None:
        if running[0]:
            fired[0] = True
            signal.setitimer(signal.ITIMER_REAL, SOFT_LIMIT_REPEAT_SECONDS, SOFT_LIMIT_REPEAT_SECONDS)
            raise SoftTimeLimitExceeded()

    before_usr1 = signal.signal(signal.SIGUSR1, first)
    before_alrm = signal.signal(signal.SIGALRM, again)
    try:
        yield fired
    finally:
        running[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before_alrm)
        signal.signal(signal.SIGUSR1, before_usr1)


def time_limited(fn: F, seconds: float, setting: str) -> F:
    """``fn`` ending in ``TaskTimeLimit`` once its soft limit has fired, whatever it raised then
    (SoftTimeLimitExceeded itself, or an error of its own that wrapped it); the soft limit made to
    stick (``_persistent_soft_limit``)."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        fired = [False]
        try:
            with _persistent_soft_limit() as fired:
                return fn(*args)
        except Exception as exc:
            if not (fired[0] or isinstance(exc, SoftTimeLimitExceeded)):
                raise
            raise TaskTimeLimit(f"ran past its time limit of {seconds:g}s ({setting})") from None

    return run  # type: ignore[return-value]


def about_batch(fn: F) -> F:
    """A task whose first argument is a batch id: every line logged while it runs (the policy's
    included, so this goes outside ``guarded``) carries that batch id."""

    @functools.wraps(fn)
    def run(self: Task, batch_id: str, *args: Any) -> Any:
        with bound(batch_id=batch_id):
            return fn(self, batch_id, *args)

    return run  # type: ignore[return-value]


def with_policy(fn: F, name: str, settings: Any, periodic_task: bool, batch_first: bool) -> F:
    """Task ``name``'s body ``fn`` wrapped in the whole policy, innermost first: its time limit,
    then the exception policy (``guarded``, or ``periodic``), then its batch id on every line."""
    limit = soft_limit(settings, name)
    if limit is not None:
        fn = time_limited(fn, *limit)
    fn = periodic(fn) if periodic_task else guarded(fn)
    return about_batch(fn) if batch_first else fn


def killed(task: Task, exc: BaseException, args: Any) -> None:
    """A task's ``on_failure``: Celery calls it, in the role's main process, for a task the hard
    limit killed (it did not stop at the soft one; its pool process was stuck). The fault is
    handled as the policy would have, from a runtime of its own (the main process holds none:
    the pool processes it forks must not share its connections)."""
    fault = getattr(task, "fault", None)
    limit = soft_limit(task.app.settings, task.name)
    if not isinstance(exc, TimeLimitExceeded) or fault is None or limit is None:
        return
    step = task.name.rpartition(".")[2]
    seconds, setting = limit
    error = describe(
        step, TaskTimeLimit(f"ran past its time limit of {seconds:g}s ({setting}) and was killed")
    )
    record = functools.partial(record_killed, task, fault, error, step, args)
    if not record():
        # the stuck pool process holds a row this needs, and it is killed only once this returns:
        # write again from a thread once the kill has freed the row
        threading.Thread(target=retry_killed, args=(record, step, args), daemon=True).start()


def record_killed(task: Task, on_fault: OnFault, error: str, step: str, args: Any) -> bool:
    """Handle a task the hard limit killed as the policy would have (``on_fault``), from a runtime
    of its own; False if a row it needed stayed locked for ``KILLED_LOCK_WAIT_MS``.

    Why the lock wait: billiard calls this (the task's ``on_failure``) before it kills the stuck
    pool process, and that process may be stopped inside a transaction holding the very batch
    row this writes. Waiting for the lock then waited for a kill that came only after the wait:
    the validation role's main process hung with the batch left ``validating``."""
    rt = Runtime(task.app.settings)
    if rt.db.engine.dialect.name == "postgresql":

        @event.listens_for(rt.db.engine, "connect")
        def wait_briefly(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute(f"SET lock_timeout = {KILLED_LOCK_WAIT_MS}")
            cursor.close()
            dbapi_connection.commit()

    try:
        with (
            bound(batch_id=args[0])
            if TASKS[task.name].args[:1] == ("batch_id",)
            else contextlib.nullcontext()
        ):
            on_fault(task, rt, error, *args)
    except Exception as exc:
        if isinstance(exc, OperationalError) and getattr(exc.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return False
        log.exception("task %s%r: recording that it was killed failed", step, tuple(args))
    finally:
        rt.db.dispose()
    return True


def retry_killed(record: Callable[[], bool], step: str, args: Any) -> None:
    """``record_killed`` again, a second apart, until the killed process's rows are free."""
    for _ in range(KILLED_RETRIES):
        time.sleep(1.0)
        if record():
            return
    log.error("task %s%r: its rows stayed locked; the lease's expiry will send it again", step, tuple(args))


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
        VALIDATION_LEASE.revoke(s, [batch_id])
        fail_validating(s, batch, one_error(f"validation failed: {error}"), int(time.time()))
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
