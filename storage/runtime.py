"""The composition root: what a process needs to do Freight's work (settings, database, object
store, task queue), each built lazily on first use.

Built once per process (API app factory, worker start-up, CLI command) and passed down. Worker
processes pass their own Celery app so sends share its connection pool; every other process gets
a producer app with no tasks registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from celery import Celery

from storage.broker import TaskQueue, make_producer
from storage.db import Database
from storage.objectstore import ObjectStore, open_object_store
from storage.objectstore_retry import RetryPolicy
from storage.secret_box import SecretBox, secret_box
from storage.settings import Settings


@dataclass
class Runtime:
    settings: Settings
    celery: Celery | None = None  # a worker process's own app; None: a producer app of its own

    @cached_property
    def db(self) -> Database:
        return Database(self.settings.database_url)

    @cached_property
    def store(self) -> ObjectStore:
        retry = RetryPolicy(deadline_seconds=self.settings.object_store_retry_seconds)
        return open_object_store(self.settings.object_store_url, self.settings.s3_endpoint_url, retry)

    @cached_property
    def secrets(self) -> SecretBox:
        """Seals and opens the stored drop-folder and webhook secrets (FREIGHT_SECRETS_KEYS)."""
        return secret_box(self.settings)

    @cached_property
    def queue(self) -> TaskQueue:
        return TaskQueue(self.celery or make_producer(self.settings))
