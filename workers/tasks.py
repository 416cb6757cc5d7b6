"""Celery tasks: a few lines each, taking ids, acknowledged late, safe to run twice.

Each calls one domain function with the process's Runtime (and, on engine workers, its warm
engine), then pokes the dispatcher so freed queue room is refilled without waiting for a tick.
Every task runs under one exception policy (``workers.task_policy``): an outage retries it with
backoff, a fault ends its batch ``failed`` (as far as the batch's states allow) naming the step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, Task

from storage.runtime import Runtime

log = logging.getLogger(__name__)


def runtime_of(app: Celery) -> Runtime:
    rt = getattr(app, "freight_runtime", None)
    if rt is None:
        rt = app.freight_runtime = Runtime(app.conf.freight_settings, celery=app)
    return rt


def register(app: Celery) -> None:
    from workers import cleanup, dispatcher, dropfolder_delivery, dropfolders, execution, finalize, validation
    from workers.task_policy import (
        MAX_RETRIES,
        fail_finalization,
        fail_pack,
        fail_validation,
        guarded,
        periodic,
        validation_retry_due,
    )

    # registered in this app only: a shared task would also be added to every app made later
    def task(name: str) -> Any:
        return app.task(name=name, shared=False, bind=True, acks_late=True, max_retries=MAX_RETRIES)

    def periodic_task(name: str) -> Any:
        return app.task(name=name, shared=False, acks_late=False, ignore_result=True)

    def poke(rt: Runtime) -> None:
        """Refill the queues now rather than at the next tick (which does the same: a failure
        here is only logged)."""
        try:
            dispatcher.enqueue_units(rt, time.time(), dispatcher.TickReport())
        except Exception:
            log.warning("refilling the queues failed; the next tick does it", exc_info=True)

    @task("freight.validate_batch")
    @guarded(
        lambda error, batch_id: fail_validation(runtime_of(app), error, batch_id),
        lambda due, batch_id: validation_retry_due(runtime_of(app), due, batch_id),
    )
    def validate_batch(self: Task, batch_id: str) -> None:
        validation.validate_batch(runtime_of(app), batch_id)
        poke(runtime_of(app))

    def pack_failed(
        error: str,
        pack_id: str,
        unit_ids: list[int],
        more_coming: bool = False,
        urgent: list[int] | None = None,
    ) -> None:
        runner: execution.PackRunner = app.freight_runner
        fail_pack(runtime_of(app), runner.worker, runner.failure is not None, error, pack_id, unit_ids)

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
        poke(runtime_of(app))

    @task("freight.finalize_batch")
    @guarded(lambda error, batch_id: fail_finalization(runtime_of(app), error, batch_id))
    def finalize_batch(self: Task, batch_id: str) -> None:
        finalize.finalize_batch(runtime_of(app), batch_id)

    @periodic_task("freight.tick")
    @periodic
    def tick() -> None:
        dispatcher.tick(runtime_of(app), time.time())

    @periodic_task("freight.cleanup")
    @periodic
    def cleanup_pass() -> None:  # periodic: a pass that fails leaves the rest to the next
        cleanup.run(runtime_of(app), time.time())

    @periodic_task("freight.scan_dropfolders")
    @periodic
    def scan_dropfolders() -> None:  # periodic: a lost one is replaced by the next
        dropfolders.poll(runtime_of(app), time.time())

    # a folder's scan and an object's delivery record their own failures and back off; a fault
    # left over has no batch to end (the next poll sends them again)
    @task("freight.scan_dropfolder")
    @guarded()
    def scan_dropfolder(self: Task, folder_id: str) -> None:
        dropfolders.scan_folder(runtime_of(app), folder_id, time.time())

    @task("freight.deliver_dropfolder_object")
    @guarded()
    def deliver_dropfolder_object(self: Task, object_id: int) -> None:
        dropfolder_delivery.deliver(runtime_of(app), object_id, time.time())
