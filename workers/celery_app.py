"""The Celery app, built from settings (never at import).

Queues: ``freight.control`` carries validation, finalization and the dispatcher tick; each served
model has its own queue ``freight.model.<name>`` consumed by engine workers (``-P solo``, one warm
vLLM engine per process). Unit tasks are acknowledged late, so a worker that dies mid-unit leaves
its task to be redelivered; the dispatcher's heartbeat lease redelivers it sooner.
"""

from __future__ import annotations

from celery import Celery

from storage.settings import Settings

CONTROL_QUEUE = "freight.control"


def model_queue(model: str) -> str:
    return f"freight.model.{model}"


def make_celery(settings: Settings) -> Celery:
    app = Celery("freight", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=CONTROL_QUEUE,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_seconds},
        worker_hijack_root_logger=False,
        beat_schedule={
            "freight-tick": {
                "task": "freight.tick",
                "schedule": settings.tick_seconds,
                "options": {"queue": CONTROL_QUEUE, "expires": max(settings.tick_seconds * 5, 10)},
            }
        },
    )
    app.conf.freight_settings = settings
    from workers.tasks import register

    register(app)
    return app


class TaskQueue:
    """Sends tasks by name, so producers (the API) need not import the task modules."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def validate(self, batch_id: str) -> None:
        self.celery.send_task("freight.validate_batch", args=[batch_id], queue=CONTROL_QUEUE)

    def finalize(self, batch_id: str) -> None:
        self.celery.send_task("freight.finalize_batch", args=[batch_id], queue=CONTROL_QUEUE)

    def run_unit(self, unit_id: int, model: str) -> None:
        self.celery.send_task("freight.run_unit", args=[unit_id], queue=model_queue(model))
