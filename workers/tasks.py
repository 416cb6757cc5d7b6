"""Celery tasks: a few lines each, taking ids, acknowledged late, safe to run twice.

Each is declared here, at module level, against its entry in ``storage.broker.TASKS`` (the table
the sending side sends by, so a task cannot drift from its sender), and registered in a worker's
app by `register`. Each calls one domain function with the process's Runtime (``self.rt``; on
engine workers also its warm `PackRunner`), then pokes the dispatcher so freed queue room is
refilled without waiting for a tick. Every task runs under the one policy of
``workers.task_policy``: an outage retries it with backoff, a fault ends its batch ``failed`` (as
far as the batch's states allow) naming the step, a time limit is a fault, and a task the hard
limit killed is handled as its fault would have been.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from celery import Task

from storage.broker import TASKS
from storage.runtime import Runtime
from workers import (
    cleanup,
    conversions,
    dispatcher,
    dropfolder_delivery,
    dropfolders,
    estimates,
    finalize,
    validation,
    validation_chunks,
    webhooks,
)
from workers.pack_feed import PackOrder
from workers.task_policy import (
    MAX_RETRIES,
    OnFault,
    OnRetry,
    fail_finalization,
    fail_pack,
    fail_validation,
    killed,
    time_limit_options,
    validation_retry_due,
    with_policy,
)
from workers.task_spans import task_span

if TYPE_CHECKING:
    from workers.celery_app import FreightCelery
    from workers.execution import PackRunner

log = logging.getLogger(__name__)


class FreightTask(Task):
    """The base of every Freight task: bound, acknowledged late (a worker lost mid-task leaves it
    to be delivered again), and given its process's Runtime. ``fault`` and ``retry_noted`` are
    the task's handlers in the policy (``workers.task_policy.guarded``), set from its declaration."""

    acks_late = True
    max_retries = MAX_RETRIES
    fault: OnFault | None = None
    retry_noted: OnRetry | None = None
    periodic = False  # beat's: no span of its own (workers/task_spans.py)

    @property
    def rt(self) -> Runtime:
        return cast("FreightCelery", self.app).runtime

    @property
    def runner(self) -> PackRunner:
        """An engine worker's runner (``workers.bootstrap`` starts it before the worker consumes)."""
        runner = cast("FreightCelery", self.app).runner
        assert runner is not None, "run_pack is served by engine workers only"
        return runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The task run in its span (a no-op with tracing off), read off this message's request."""
        with task_span(self.rt, self.name, self.request, args, self.periodic):
            return super().__call__(*args, **kwargs)

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        killed(self, exc, args)


@dataclass(frozen=True)
class Declared:
    run: Callable[..., Any]
    fault: OnFault | None
    retry_noted: OnRetry | None
    periodic: bool


DECLARED: dict[str, Declared] = {}


def declare(
    name: str, fault: OnFault | None = None, retry_noted: OnRetry | None = None, periodic: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the task ``name`` (a key of ``storage.broker.TASKS``): its parameters after the task
    itself must be the arguments its sender sends, checked here, when this module is imported."""

    def declared(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = tuple(inspect.signature(fn).parameters)[1:]
        if params != TASKS[name].args:
            raise TypeError(f"task {name} takes {params}; storage.broker.TASKS sends {TASKS[name].args}")
        DECLARED[name] = Declared(fn, fault, retry_noted, periodic)
        return fn

    return declared


def register(app: FreightCelery) -> None:
    """Every declared task in ``app`` (and in it only: a shared task would be added to every app
    made later), wrapped in the policy, with its time limits from the app's settings."""
    for name, task in DECLARED.items():
        app.task(
            with_policy(task.run, name, app.settings, task.periodic, TASKS[name].args[:1] == ("batch_id",)),
            name=name,
            base=FreightTask,
            shared=False,
            bind=True,
            # a periodic task lost with its worker is replaced by the next period's
            acks_late=not task.periodic,
            periodic=task.periodic,
            ignore_result=True,
            fault=staticmethod(task.fault) if task.fault else None,
            retry_noted=staticmethod(task.retry_noted) if task.retry_noted else None,
            **time_limit_options(app.settings, name),
        )


def poke(rt: Runtime, model: str | None = None) -> None:
    """Refill the queues now rather than at the next tick (which does the same: a failure here is
    only logged); ``model``: only that model's, the queue a taken pack left room in."""
    try:
        dispatcher.enqueue_units(rt, time.time(), dispatcher.TickReport(), model=model)
    except Exception:
        log.warning("refilling the queues failed; the next tick does it", exc_info=True)


# -- what a fault ends (task, the runtime to record with, the error, the task's arguments) --------


def end_validation(task: Task, rt: Runtime, error: str, batch_id: str, *chunk: int) -> None:
    """The batch fails (a chunk's fault fails its batch, as one task's would), and is told."""
    fail_validation(rt, error, batch_id)
    webhooks.send_due_quietly(rt, batch_id)


def end_finalization(task: Task, rt: Runtime, error: str, batch_id: str) -> None:
    fail_finalization(rt, error, batch_id)
    webhooks.send_due_quietly(rt, batch_id)


def end_estimate(task: Task, rt: Runtime, error: str, estimate_id: str) -> None:
    estimates.fail(rt, estimate_id, f"the estimate failed: {error}")


def end_conversion(task: Task, rt: Runtime, error: str, file_id: str, fmt: str) -> None:
    conversions.fail(rt, file_id, fmt, error)


def end_pack(task: FreightTask, rt: Runtime, error: str, pack_id: str, unit_ids: list[int], *_: Any) -> None:
    runner = task.runner
    fail_pack(rt, runner.holder, runner.failure is not None, error, pack_id, unit_ids)


# -- the tasks ------------------------------------------------------------------------------------


@declare("freight.validate_batch", fault=end_validation, retry_noted=validation_retry_due)
def validate_batch(self: FreightTask, batch_id: str) -> None:
    wait = validation.validate_batch(self.rt, batch_id, validation_chunks.validate_in_chunks)
    if wait is not None:  # its tenant's turns are taken: asked again later, this one acknowledged
        self.rt.queue.validate(batch_id, countdown=wait)
        return
    webhooks.send_due_quietly(self.rt, batch_id)  # a file that failed validation
    poke(self.rt)


# one chunk of a large input (workers/validation_chunks.py); the last one done sends the batch's
# validation again, which merges. An outage retries it; the tick sends a lost one again
@declare("freight.validate_chunk", fault=end_validation)
def validate_chunk(self: FreightTask, batch_id: str, chunk_id: int) -> None:
    validation_chunks.validate_chunk(self.rt, batch_id, chunk_id)


# a dry run (workers/estimates.py): the file read as validation reads it, nothing run; while its
# tenant's validation turns are taken, asked again later (this one acknowledged)
@declare("freight.estimate", fault=end_estimate)
def estimate(self: FreightTask, estimate_id: str) -> None:
    wait = estimates.run(self.rt, estimate_id)
    if wait is not None:
        self.rt.queue.estimate(estimate_id, countdown=wait)


# a file's content in the other format, for its downloads (workers/conversions.py): a fault is
# remembered as the conversion's refusal, so the file is not converted again on every download
@declare("freight.convert_file", fault=end_conversion)
def convert_file(self: FreightTask, file_id: str, fmt: str) -> None:
    conversions.convert(self.rt, file_id, fmt)


@declare("freight.run_pack", fault=end_pack)
def run_pack(
    self: FreightTask,
    pack_id: str,
    unit_ids: list[int],
    more_coming: bool = False,
    urgent: list[int] | None = None,
    newest_batch_at: float | None = None,
) -> None:
    self.runner.run_pack(PackOrder(pack_id, unit_ids, more_coming, urgent or (), newest_batch_at))
    poke(self.rt, self.runner.model)


@declare("freight.finalize_batch", fault=end_finalization)
def finalize_batch(self: FreightTask, batch_id: str) -> None:
    finalize.finalize_batch(self.rt, batch_id)
    webhooks.send_due_quietly(self.rt, batch_id)


# one attempt of a webhook delivery; it records its own failure and retry time, and the tick
# sends it again when due (an outage here retries the task, then leaves it to the tick)
@declare("freight.deliver_webhook")
def deliver_webhook(self: FreightTask, delivery_id: int) -> None:
    webhooks.deliver(self.rt, delivery_id, time.time())


@declare("freight.tick", periodic=True)
def tick(self: FreightTask) -> None:
    dispatcher.tick(self.rt, time.time())


@declare("freight.cleanup", periodic=True)
def cleanup_pass(self: FreightTask) -> None:  # a pass that fails leaves the rest to the next
    cleanup.run(self.rt, time.time())


@declare("freight.scan_dropfolders", periodic=True)
def scan_dropfolders(self: FreightTask) -> None:  # a lost one is replaced by the next
    dropfolders.poll(self.rt, time.time())


# a folder's scan and an object's delivery record their own failures and back off; a fault left
# over has no batch to end (the next poll sends them again)
@declare("freight.scan_dropfolder")
def scan_dropfolder(self: FreightTask, folder_id: str) -> None:
    dropfolders.scan_folder(self.rt, folder_id, time.time())


@declare("freight.deliver_dropfolder_object")
def deliver_dropfolder_object(self: FreightTask, object_id: int) -> None:
    dropfolder_delivery.deliver(self.rt, object_id, time.time())
