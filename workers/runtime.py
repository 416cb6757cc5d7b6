"""What a process needs to do Freight's work: settings, database, object store, task queue.

Built once per process (API app factory, worker start-up, CLI command) and passed down.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from storage.db import Database
from storage.objectstore import ObjectStore, open_object_store
from storage.objectstore_retry import RetryPolicy
from storage.settings import Settings
from workers.celery_app import TaskQueue, make_celery


@dataclass
class Runtime:
    settings: Settings

    @cached_property
    def db(self) -> Database:
        return Database(self.settings.database_url)

    @cached_property
    def store(self) -> ObjectStore:
        retry = RetryPolicy(deadline_seconds=self.settings.object_store_retry_seconds)
        return open_object_store(self.settings.object_store_url, self.settings.s3_endpoint_url, retry)

    @cached_property
    def queue(self) -> TaskQueue:
        return TaskQueue(make_celery(self.settings))
