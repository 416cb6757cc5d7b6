"""The Celery app, built from settings (never at import).

Queues: ``freight.control`` carries validation, finalization, the dispatcher tick and the S3 drop
folders' scans and deliveries; each served model has its own queue ``freight.model.<name>``
consumed by engine workers (``-P solo``, one warm vLLM engine per process), which take packs of
work units from it. A pack task returns once its requests are on the worker's feed (so the next
pack arrives before the engine runs dry); from then on the units' database leases, heartbeated by
the worker, are what redelivers a dead worker's work.
"""

from __future__ import annotations

from celery import Celery
from kombu.exceptions import OperationalError as KombuOperationalError

from storage.settings import Settings

CONTROL_QUEUE = "freight.control"
# what sending a task raises when the broker cannot be reached (after kombu's own retries)
BROKER_ERRORS = (KombuOperationalError, ConnectionError)


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
            },
            "freight-scan-dropfolders": {
                "task": "freight.scan_dropfolders",
                "schedule": settings.dropfolder_poll_seconds,
                "options": {"queue": CONTROL_QUEUE, "expires": max(settings.dropfolder_poll_seconds * 5, 10)},
            },
        },
    )
    app.conf.freight_settings = settings
    from workers.tasks import register

    register(app)
    return app


# A key the dispatcher keeps in the broker: gone means the broker lost its data, messages included.
BROKER_MARKER_KEY = "freight:broker-marker"


class TaskQueue:
    """Sends tasks by name, so producers (the API) need not import the task modules."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def broker_was_reset(self) -> bool:
        """True once after the broker lost everything it held (Redis restarted without persistence,
        or a new one): the marker this sets is missing. Then every queued message is gone too and
        the database, not the broker, says what must be sent again. False on brokers other than
        Redis (nothing to check)."""
        # a pooled connection: the dispatcher asks every tick, and a new one costs a connect
        with self.celery.pool.acquire(block=True) as conn:
            client = getattr(conn.default_channel, "client", None)
            if client is None or not hasattr(client, "set"):
                return False
            return bool(client.set(BROKER_MARKER_KEY, "1", nx=True))

    def validate(self, batch_id: str) -> None:
        self.celery.send_task("freight.validate_batch", args=[batch_id], queue=CONTROL_QUEUE)

    def finalize(self, batch_id: str) -> None:
        self.celery.send_task("freight.finalize_batch", args=[batch_id], queue=CONTROL_QUEUE)

    def run_pack(self, pack_id: str, model: str, unit_ids: list[int]) -> None:
        self.celery.send_task("freight.run_pack", args=[pack_id, unit_ids], queue=model_queue(model))

    def scan_dropfolder(self, folder_id: str, expires: float) -> None:
        self.celery.send_task(
            "freight.scan_dropfolder", args=[folder_id], queue=CONTROL_QUEUE, expires=expires
        )

    def deliver_dropfolder_object(self, object_id: int, expires: float) -> None:
        self.celery.send_task(
            "freight.deliver_dropfolder_object", args=[object_id], queue=CONTROL_QUEUE, expires=expires
        )
