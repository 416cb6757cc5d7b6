"""The Celery app of worker and beat processes: the shared configuration, the beat schedule and
every task registered. Producers send by name through ``storage.broker.TaskQueue`` instead.

A pack task returns once its requests are on the worker's feed (so the next pack arrives before
the engine runs dry); from then on the units' database leases, heartbeated by the worker, are what
redelivers a dead worker's work.
"""

from __future__ import annotations

from celery import Celery

from storage.broker import TASK_QUEUES, celery_config
from storage.settings import Settings


def make_celery(settings: Settings) -> Celery:
    app = Celery("freight", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        celery_config(settings),
        beat_schedule={
            "freight-tick": {
                "task": "freight.tick",
                "schedule": settings.tick_seconds,
                "options": {
                    "queue": TASK_QUEUES["freight.tick"],
                    "expires": max(settings.tick_seconds * 5, 10),
                },
            },
            "freight-cleanup": {
                "task": "freight.cleanup",
                "schedule": settings.cleanup_seconds,
                "options": {
                    "queue": TASK_QUEUES["freight.cleanup"],
                    "expires": max(settings.cleanup_seconds * 5, 10),
                },
            },
            "freight-scan-dropfolders": {
                "task": "freight.scan_dropfolders",
                "schedule": settings.dropfolder_poll_seconds,
                "options": {
                    "queue": TASK_QUEUES["freight.scan_dropfolders"],
                    "expires": max(settings.dropfolder_poll_seconds * 5, 10),
                },
            },
        },
    )
    app.conf.freight_settings = settings
    from workers.tasks import register

    register(app)
    return app
