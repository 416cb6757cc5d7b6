"""Celery tasks: a few lines each, taking ids, acknowledged late, safe to run twice.

Each calls one domain function with the process's Runtime (and, on engine workers, its warm
engine), then pokes the dispatcher so freed queue room is refilled without waiting for a tick.
Every task runs under one exception policy (``workers.task_policy``): an outage retries it with
backoff, a fault ends its batch ``failed`` (as far as the batch's states allow) naming the step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from storage.logs import bound
from storage.runtime import Runtime

log = logging.getLogger(__name__)

# the hard time limit's handler (``killed``): how long its write waits for a row lock (PostgreSQL),
# and how often, a second apart, it tries again once the killed process has let go of its rows
KILLED_LOCK_WAIT_MS = 2000
KILLED_RETRIES = 60
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for a lock_timeout that ran out


def record_killed(settings: Any, on_fault: Any, error: str, step: str, args: Any) -> bool:
    """Handle a task the hard limit killed as the policy would have (``on_fault``), from a runtime
    of its own; False if a row it needed stayed locked for ``KILLED_LOCK_WAIT_MS``.

    Why the lock wait: billiard calls this (the task's ``on_failure``) before it kills the stuck
    pool process, and that process may be stopped inside a transaction holding the very batch
    row this writes. Waiting for the lock then waited for a kill that came only after the wait:
    the validation role's main process hung with the batch left ``validating``."""
    rt = Runtime(settings)
    if rt.db.engine.dialect.name == "postgresql":

        @event.listens_for(rt.db.engine, "connect")
        def wait_briefly(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute(f"SET lock_timeout = {KILLED_LOCK_WAIT_MS}")
            cursor.close()
            dbapi_connection.commit()

    try:
        with bound(batch_id=args[0]):  # the tasks killed() serves all take a batch id first
            on_fault(rt, error, *args)
    except Exception as exc:
        if isinstance(exc, OperationalError) and getattr(exc.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return False
        log.exception("task %s%r: recording that it was killed failed", step, tuple(args))
    finally:
        rt.db.dispose()
    return True


def retry_killed(record: Any, step: str, args: Any) -> None:
    """``record_killed`` again, a second apart, until the killed process's rows are free."""
    for _ in range(KILLED_RETRIES):
        time.sleep(1.0)
        if record():
            return
    log.error("task %s%r: its rows stayed locked; the lease's expiry will send it again", step, tuple(args))


class TaskTimeLimit(RuntimeError):
    """A task ran past its time limit (a fault to the exception policy: it would again)."""


SOFT_LIMIT_REPEAT_SECONDS = 0.2


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


def _time_limited(fn: Any, *, seconds: float, setting: str) -> Any:
    """``fn`` ending in ``TaskTimeLimit`` once its soft limit has fired, whatever it raised then
    (SoftTimeLimitExceeded itself, or an error of its own that wrapped it)."""

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

    return run


def about_batch(fn: Any) -> Any:
    """A task whose first argument is a batch id: every line logged while it runs (its exception
    policy's included, so this goes outside ``guarded``) carries that batch id."""

    @functools.wraps(fn)
    def run(self: Task, batch_id: str, *args: Any) -> Any:
        with bound(batch_id=batch_id):
            return fn(self, batch_id, *args)

    return run


def runtime_of(app: Celery) -> Runtime:
    rt = getattr(app, "freight_runtime", None)
    if rt is None:
        rt = app.freight_runtime = Runtime(app.conf.freight_settings, celery=app)
    return rt


def register(app: Celery) -> None:
    from workers import (
        cleanup,
        dispatcher,
        dropfolder_delivery,
        dropfolders,
        estimates,
        execution,
        finalize,
        validation,
        validation_chunks,
        webhooks,
    )
    from workers.task_policy import (
        MAX_RETRIES,
        describe,
        fail_finalization,
        fail_pack,
        fail_validation,
        guarded,
        periodic,
        validation_retry_due,
    )

    settings = app.conf.freight_settings
    limits = {  # task -> (soft limit in seconds, the setting that gives it)
        "freight.validate_batch": (settings.validation_time_limit_seconds, "VALIDATION"),
        "freight.validate_chunk": (settings.validation_time_limit_seconds, "VALIDATION"),
        "freight.estimate": (settings.validation_time_limit_seconds, "VALIDATION"),
        "freight.finalize_batch": (settings.finalize_time_limit_seconds, "FINALIZE"),
        "freight.scan_dropfolder": (settings.finalize_time_limit_seconds, "FINALIZE"),
        "freight.deliver_dropfolder_object": (settings.finalize_time_limit_seconds, "FINALIZE"),
        "freight.tick": (settings.tick_time_limit_seconds, "TICK"),
        "freight.scan_dropfolders": (settings.tick_time_limit_seconds, "TICK"),
        # a pass of deletions may be long; what it leaves, the next pass does
        "freight.cleanup": (settings.tick_time_limit_seconds * 10, "TICK"),
    }

    def time_limits(name: str) -> dict[str, float]:
        """Past the soft limit the task meets ``TaskTimeLimit`` (the exception policy then ends it:
        a fault, or for a periodic task the next period); the hard limit, a grace later, kills the
        pool process if it did not stop. Enforced by the control roles' prefork pools only."""
        if name not in limits:
            return {}
        soft = limits[name][0]
        return {"soft_time_limit": soft, "time_limit": soft + max(10.0, soft / 10)}

    def limited(name: str) -> Any:
        """Turns Celery's SoftTimeLimitExceeded into an error that names the limit and its setting,
        and makes the soft limit stick (``_persistent_soft_limit``)."""
        seconds, which = limits[name]
        return functools.partial(
            _time_limited, seconds=seconds, setting=f"FREIGHT_{which}_TIME_LIMIT_SECONDS"
        )

    def killed(on_fault: Any) -> Any:
        """A task's ``on_failure``: Celery calls it, in the role's main process, for a task the hard
        limit killed (it did not stop at the soft one; its pool process was stuck). The fault is
        handled as the policy would have, from a runtime of its own (the main process holds none:
        the pool processes it forks must not share its connections)."""

        def on_failure(
            task: Task, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any
        ) -> None:
            if not isinstance(exc, TimeLimitExceeded):
                return
            seconds, which = limits[task.name]
            step = task.name.rpartition(".")[2]
            error = describe(step, TaskTimeLimit(
                f"ran past its time limit of {seconds:g}s (FREIGHT_{which}_TIME_LIMIT_SECONDS) and was killed"))  # fmt: skip
            record = functools.partial(record_killed, settings, on_fault, error, step, args)
            if not record():
                # the stuck pool process holds a row this needs, and it is killed only once this
                # returns: write again from a thread once the kill has freed the row
                threading.Thread(target=retry_killed, args=(record, step, args), daemon=True).start()

        return on_failure

    # registered in this app only: a shared task would also be added to every app made later
    def task(name: str, **extra: Any) -> Any:
        return app.task(
            name=name,
            shared=False,
            bind=True,
            acks_late=True,
            max_retries=MAX_RETRIES,
            **time_limits(name),
            **extra,
        )

    def periodic_task(name: str) -> Any:
        return app.task(name=name, shared=False, acks_late=False, ignore_result=True, **time_limits(name))

    def poke(rt: Runtime, model: str | None = None) -> None:
        """Refill the queues now rather than at the next tick (which does the same: a failure
        here is only logged); ``model``: only that model's, the queue a taken pack left room in."""
        try:
            dispatcher.enqueue_units(rt, time.time(), dispatcher.TickReport(), model=model)
        except Exception:
            log.warning("refilling the queues failed; the next tick does it", exc_info=True)

    def failed_and_told(on_fault: Any) -> Any:
        """A fault handler that may end a batch, then sends its webhook deliveries."""

        def handle(rt: Runtime, error: str, batch_id: str, *rest: Any) -> None:
            on_fault(rt, error, batch_id, *rest)
            webhooks.send_due_quietly(rt, batch_id)

        return handle

    end_validation = failed_and_told(fail_validation)
    end_finalization = failed_and_told(fail_finalization)

    @task("freight.validate_batch", on_failure=killed(end_validation))
    @about_batch
    @guarded(
        lambda error, batch_id: end_validation(runtime_of(app), error, batch_id),
        lambda due, batch_id: validation_retry_due(runtime_of(app), due, batch_id),
    )
    @limited("freight.validate_batch")
    def validate_batch(self: Task, batch_id: str) -> None:
        wait = validation.validate_batch(runtime_of(app), batch_id, validation_chunks.validate_in_chunks)
        if wait is not None:  # its tenant's turns are taken: asked again later, this one acknowledged
            runtime_of(app).queue.validate(batch_id, countdown=wait)
            return
        webhooks.send_due_quietly(runtime_of(app), batch_id)  # a file that failed validation
        poke(runtime_of(app))

    def chunk_failed(rt: Runtime, error: str, batch_id: str, chunk_id: int) -> None:
        end_validation(rt, error, batch_id)  # a chunk's fault fails its batch, as one task's would

    # one chunk of a large input (workers/validation_chunks.py); the last one done sends the batch's
    # validation again, which merges. An outage retries it; the tick sends a lost one again
    @task("freight.validate_chunk", on_failure=killed(chunk_failed))
    @about_batch
    @guarded(lambda error, batch_id, chunk_id: chunk_failed(runtime_of(app), error, batch_id, chunk_id))
    @limited("freight.validate_chunk")
    def validate_chunk(self: Task, batch_id: str, chunk_id: int) -> None:
        validation_chunks.validate_chunk(runtime_of(app), batch_id, chunk_id)

    def estimate_failed(rt: Runtime, error: str, estimate_id: str) -> None:
        estimates.fail(rt, estimate_id, f"the estimate failed: {error}")

    # a dry run (workers/estimates.py): the file read as validation reads it, nothing run
    @task("freight.estimate", on_failure=killed(estimate_failed))
    @guarded(lambda error, estimate_id: estimate_failed(runtime_of(app), error, estimate_id))
    @limited("freight.estimate")
    def estimate(self: Task, estimate_id: str) -> None:
        estimates.run(runtime_of(app), estimate_id)

    def pack_failed(
        error: str,
        pack_id: str,
        unit_ids: list[int],
        more_coming: bool = False,
        urgent: list[int] | None = None,
    ) -> None:
        runner: execution.PackRunner = app.freight_runner
        fail_pack(runtime_of(app), runner.holder, runner.failure is not None, error, pack_id, unit_ids)

    @task("freight.run_pack")
    @guarded(pack_failed)
    def run_pack(
        self: Task,
        pack_id: str,
        unit_ids: list[int],
        more_coming: bool = False,
        urgent: list[int] | None = None,
    ) -> None:
        runner: execution.PackRunner = app.freight_runner  # started with the engine worker
        runner.run_pack(pack_id, unit_ids, more_coming=more_coming, urgent=urgent or ())
        poke(runtime_of(app), runner.model)

    @task("freight.finalize_batch", on_failure=killed(end_finalization))
    @about_batch
    @guarded(lambda error, batch_id: end_finalization(runtime_of(app), error, batch_id))
    @limited("freight.finalize_batch")
    def finalize_batch(self: Task, batch_id: str) -> None:
        finalize.finalize_batch(runtime_of(app), batch_id)
        webhooks.send_due_quietly(runtime_of(app), batch_id)

    # one attempt of a webhook delivery; it records its own failure and retry time, and the tick
    # sends it again when due (an outage here retries the task, then leaves it to the tick)
    @task("freight.deliver_webhook")
    @guarded()
    def deliver_webhook(self: Task, delivery_id: int) -> None:
        webhooks.deliver(runtime_of(app), delivery_id, time.time())

    @periodic_task("freight.tick")
    @periodic
    @limited("freight.tick")
    def tick() -> None:
        dispatcher.tick(runtime_of(app), time.time())

    @periodic_task("freight.cleanup")
    @periodic
    @limited("freight.cleanup")
    def cleanup_pass() -> None:  # periodic: a pass that fails leaves the rest to the next
        cleanup.run(runtime_of(app), time.time())

    @periodic_task("freight.scan_dropfolders")
    @periodic
    @limited("freight.scan_dropfolders")
    def scan_dropfolders() -> None:  # periodic: a lost one is replaced by the next
        dropfolders.poll(runtime_of(app), time.time())

    # a folder's scan and an object's delivery record their own failures and back off; a fault
    # left over has no batch to end (the next poll sends them again)
    @task("freight.scan_dropfolder")
    @guarded()
    @limited("freight.scan_dropfolder")
    def scan_dropfolder(self: Task, folder_id: str) -> None:
        dropfolders.scan_folder(runtime_of(app), folder_id, time.time())

    @task("freight.deliver_dropfolder_object")
    @guarded()
    @limited("freight.deliver_dropfolder_object")
    def deliver_dropfolder_object(self: Task, object_id: int) -> None:
        dropfolder_delivery.deliver(runtime_of(app), object_id, time.time())
