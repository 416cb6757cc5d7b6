"""A span per Celery task (storage/tracing.py): in its batch's trace when the task is about a batch.

A task whose first argument is a batch id (validation, a chunk of it, finalization), or a webhook
delivery of a batch's event, is a child of the span stored on the batch's row, whichever process
sent it (the API, the tick redelivering it, an engine worker after a batch's last unit). Any other
task is the root of a trace of its own (a pack holds units of many batches: in one batch's trace it
would stand for the others'; each unit's own span is in its batch's trace and links to its pack's,
``workers/unit_spans.py``). Either links to the sender's span, carried in the message headers.
Periodic tasks (the tick, cleanup, drop-folder polls) make no span: one trace a second of nothing
would bury the batches'.

Tracing off, this costs one environment lookup a task; on, one primary-key read for a batch's task
(two for a delivery's). A read that fails leaves the span out of the batch's trace, never the task
failed: the task meets the outage itself, under its policy (``workers.task_policy``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from sqlalchemy import select

from storage import tracing
from storage.broker import TASKS
from storage.models import Batch, WebhookDelivery
from storage.runtime import Runtime

log = logging.getLogger(__name__)

# tasks whose message names a webhook delivery, not a batch: the delivery's row names the batch
DELIVERY_TASKS = frozenset({"freight.deliver_webhook"})


def batch_of(rt: Runtime, name: str, args: tuple[Any, ...]) -> str | None:
    """The batch a task is about, from its arguments (and a delivery's row), else None."""
    if not args:
        return None
    if TASKS[name].args[:1] == ("batch_id",):
        return str(args[0])
    if name in DELIVERY_TASKS:
        with rt.db.read() as s:
            return s.scalar(select(WebhookDelivery.batch_id).where(WebhookDelivery.id == args[0]))
    return None


def sender_context(request: Any) -> Any:
    """The sender's context from a task's message headers (Celery puts custom headers on the
    request itself; older protocols under ``headers``)."""
    value = getattr(request, tracing.TRACEPARENT, None) or (getattr(request, "headers", None) or {}).get(
        tracing.TRACEPARENT
    )
    return tracing.context_of(value if isinstance(value, str) else None)


def _batch_row(rt: Runtime, batch_id: str) -> Any:
    """The batch's (trace_context, tenant_id, model), or None if it is gone."""
    with rt.db.read() as s:
        return s.execute(
            select(Batch.trace_context, Batch.tenant_id, Batch.model).where(Batch.id == batch_id)
        ).one_or_none()


@contextmanager
def _task_span(rt: Runtime, name: str, request: Any, args: tuple[Any, ...]) -> Iterator[None]:
    sender = sender_context(request)
    parent = otel_context.Context()  # a root, unless the task is about a batch
    attributes: dict[str, Any] = {"messaging.system": "celery", "celery.task_name": name}
    links = [] if sender is None else [trace.Link(trace.get_current_span(sender).get_span_context())]
    batch_id = row = None
    try:
        if (batch_id := batch_of(rt, name, args)) is not None:
            attributes[tracing.BATCH_ID] = batch_id
            row = _batch_row(rt, batch_id)
    except Exception:  # the database is out: the task itself meets it, under its policy
        log.debug("task %s: its batch's trace context not read", name, exc_info=True)
    if row is not None:
        stored, attributes[tracing.TENANT], attributes[tracing.MODEL] = row
        if (batch_parent := tracing.context_of(stored)) is not None:
            parent = batch_parent
    with tracing.span(name, parent, attributes, links=links):
        yield


def task_span(rt: Runtime, name: str, request: Any, args: tuple[Any, ...], periodic: bool) -> Any:
    """The context manager a task runs in: its span, or nothing when tracing is off or the task is
    periodic."""
    if periodic or not tracing.enabled():
        return nullcontext()
    return _task_span(rt, name, request, args)
