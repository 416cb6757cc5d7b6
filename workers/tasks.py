"""Celery tasks: a few lines each, taking ids, acknowledged late, safe to run twice.

Each calls one domain function with the process's Runtime (and, on engine workers, its warm
engine), then pokes the dispatcher so freed queue room is refilled without waiting for a tick.
"""

from __future__ import annotations

import time

from celery import Celery

from storage.runtime import Runtime


def runtime_of(app: Celery) -> Runtime:
    rt = getattr(app, "freight_runtime", None)
    if rt is None:
        rt = app.freight_runtime = Runtime(app.conf.freight_settings, celery=app)
    return rt


def register(app: Celery) -> None:
    from workers import dispatcher, dropfolder_delivery, dropfolders, execution, finalize, validation

    @app.task(name="freight.validate_batch", acks_late=True)
    def validate_batch(batch_id: str) -> None:
        rt = runtime_of(app)
        validation.validate_batch(rt, batch_id)
        dispatcher.enqueue_units(rt, time.time(), dispatcher.TickReport())

    @app.task(name="freight.run_pack", acks_late=True)
    def run_pack(pack_id: str, unit_ids: list[int]) -> None:
        runner: execution.PackRunner = app.freight_runner  # started with the engine worker
        runner.run_pack(pack_id, unit_ids)
        dispatcher.enqueue_units(runtime_of(app), time.time(), dispatcher.TickReport())

    @app.task(name="freight.finalize_batch", acks_late=True)
    def finalize_batch(batch_id: str) -> None:
        finalize.finalize_batch(runtime_of(app), batch_id)

    @app.task(name="freight.tick", acks_late=False, ignore_result=True)
    def tick() -> None:
        dispatcher.tick(runtime_of(app), time.time())

    @app.task(name="freight.scan_dropfolders", acks_late=False, ignore_result=True)
    def scan_dropfolders() -> None:  # periodic: a lost one is replaced by the next
        dropfolders.poll(runtime_of(app), time.time())

    @app.task(name="freight.scan_dropfolder", acks_late=True)
    def scan_dropfolder(folder_id: str) -> None:
        dropfolders.scan_folder(runtime_of(app), folder_id, time.time())

    @app.task(name="freight.deliver_dropfolder_object", acks_late=True)
    def deliver_dropfolder_object(object_id: int) -> None:
        dropfolder_delivery.deliver(runtime_of(app), object_id, time.time())
