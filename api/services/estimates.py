"""Dry runs, the tenant's side: ``POST /v1/batches`` with ``dry_run: true`` makes an estimate
waiting for its task, and ``GET /v1/batches/{estimate_id}`` reads it.

The answer is made off the request path, on the validation role (``workers.estimates.run``: the
file read, tokenized and sorted as a batch's would be, which needs vLLM's request models and the
model's tokenizer an API host does not have); this half only checks the request, records the row
and sends the task, so an API process imports none of validation.

A tenant has at most FREIGHT_TENANT_VALIDATIONS estimates not yet answered (past that, a 429
``too_many_estimates``), and its estimates being made count with its validations against that one
limit on the validation pool (``workers.estimates``). An answered estimate is kept
FREIGHT_ESTIMATE_RETENTION_SECONDS, then deleted by the cleanup (its id then answers 404).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, func, select

from storage.broker import BROKER_ERRORS
from storage.errors import ServiceError
from storage.idempotency import note_created
from storage.models import Estimate, Tenant
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import EstimateStatus
from workers import intake

ID_PREFIX = "estimate_"
ESTIMATE_RETRY_AFTER_SECONDS = 5  # a small file's estimate takes about this long


def dry_run_requested(payload: Any) -> bool:
    """The create body's ``dry_run``: absent or false makes a batch; anything but a boolean is a 400."""
    value = payload.get("dry_run", False) if isinstance(payload, dict) else False
    if not isinstance(value, bool):
        raise ServiceError("invalid_request", "dry_run must be a boolean (true or false)", param="dry_run")
    return value


def create(rt: Runtime, tenant_id: str, payload: Any, resumed_from: str | None = None) -> Estimate:
    """A dry run of a batch create: the same checks of the request and of the file (the tenant's
    own, live, purpose ``batch``), then the estimate row, committed, and its task sent.
    ``resumed_from``: the dry run of a resume of that batch (checked by the caller)."""
    request = intake.check_request(rt, payload)
    settings: Settings = rt.settings
    now = int(time.time())
    with rt.db.write() as s:
        intake.input_file(s, tenant_id, request.input_file_id, now)
        # the tenant's row first: of creates racing, each counts after the one before committed
        s.get(Tenant, tenant_id, with_for_update=True)
        waiting = s.scalar(
            select(func.count())
            .select_from(Estimate)
            .where(
                Estimate.tenant_id == tenant_id,
                Estimate.status == EstimateStatus.VALIDATING,
                Estimate.created_at > now - settings.validation_time_limit_seconds,
            )
        )
        if (waiting or 0) >= settings.tenant_validations:
            raise ServiceError(
                "rate_limited",
                f"{waiting} estimates of yours are still being made (at most {settings.tenant_validations}"
                " at once): retrieve them, then ask again",
                code="too_many_estimates",
                retry_after=ESTIMATE_RETRY_AFTER_SECONDS,
            )
        row = Estimate(
            tenant_id=tenant_id,
            input_file_id=request.input_file_id,
            endpoint=request.endpoint,
            completion_window=request.window,
            price_multiplier=request.tier.price_multiplier,
            metadata_=request.metadata,
            status=EstimateStatus.VALIDATING,
            created_at=now,
            resumed_from=resumed_from,
        )
        s.add(row)
        s.flush()
        note_created(s, "batch.estimate", row.id)  # a retry after a crash answers this estimate
    try:
        rt.queue.estimate(row.id)  # after the commit that made the row
    except BROKER_ERRORS:
        with rt.db.write() as s:
            s.execute(delete(Estimate).where(Estimate.id == row.id))
        raise
    return row


def get(rt: Runtime, tenant_id: str, estimate_id: str) -> Estimate:
    with rt.db.read() as s:
        row = s.get(Estimate, estimate_id)
    if row is None or row.tenant_id != tenant_id:
        raise ServiceError("not_found", f"No such estimate: {estimate_id[:100]}", param="batch_id")
    return row
