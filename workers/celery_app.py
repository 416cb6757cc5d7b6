"""The Celery app of worker and beat processes: the shared configuration, the beat schedule and
every task registered. Producers send by name through ``storage.broker.TaskQueue`` instead.

A pack task returns once its requests are on the worker's feed (so the next pack arrives before
the engine runs dry); from then on the units' database leases, heartbeated by the worker, are what
redelivers a dead worker's work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery import Celery

from storage.broker import TASK_QUEUES, celery_config
from storage.runtime import Runtime
from storage.settings import Settings

if TYPE_CHECKING:
    from workers.execution import PackRunner


class FreightCelery(Celery):
    """A worker or beat process's app, and what its tasks find through it (``FreightTask.rt``):
    the settings it was made with, the process's `Runtime`, and on an engine worker its warm
    `PackRunner` (``workers.bootstrap`` starts it before the worker consumes)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("freight", broker=settings.broker_url, set_as_current=False)
        self.settings = settings
        self.runner: PackRunner | None = None
        self._runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        """Made on first use, in the process that uses it: a prefork pool process makes its own
        after the fork, so no two processes share a connection pool."""
        if self._runtime is None:
            self._runtime = Runtime(self.settings, celery=self)
        return self._runtime

    @runtime.setter
    def runtime(self, rt: Runtime) -> None:  # a test's own, or one made ahead of a thread pool
        self._runtime = rt


def make_celery(settings: Settings) -> FreightCelery:
    app = FreightCelery(settings)
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
    from workers.tasks import register

    register(app)
    return app
