"""The /metrics gauges the shipped alert rules need beyond the queue and cost figures
(``infra/monitoring/freight-alerts.yml``): live engine workers per model, units handed out again,
running units the tick has not taken back long after their worker went silent, the error share of recently finished lines, when the oldest batch waiting for validation or
finalization, webhook endpoints Freight disabled, and each tenant's quota use. Read from the
database at scrape time like the rest of ``api.services.monitoring``, so every API process answers
the same; each is one grouped query (the quota use: four per tenant)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.services.monitoring import live_samples
from api.services.reports import NO_MODEL, as_int, in_window
from api.services.webhooks import DISABLED_BY_TENANT
from storage import tick_clock
from storage.models import Batch, Tenant, WebhookEndpoint, WorkUnit
from storage.quotas import open_batches, queued_requests, quota_of, stored_bytes
from storage.runtime import Runtime
from storage.status import BatchStatus, EndpointStatus, UnitStatus
from workers.identity import holder_of

# the tick takes a running unit back once its heartbeat is a lease old (FREIGHT_LEASE_SECONDS); one
# silent for three leases means the tick has not run for at least two (or cannot)
UNRECLAIMED_LEASES = 3
ERROR_WINDOW_SECONDS = 3600.0  # freight_request_error_ratio: batches finished in the last hour
QUOTAS = ("stored_bytes", "open_batches", "queued_requests")  # the `quota` label's values
# the `state` label of freight_webhook_endpoints
ENDPOINT_STATES = ("active", "disabled_by_tenant", "disabled_failing")


@dataclass(frozen=True)
class OperationsSnapshot:
    engine_workers: Mapping[str, int]  # model -> workers with a recent sample or a live running unit
    unit_redeliveries: Mapping[str, int]  # model -> claims past each unit's first, open batches
    unreclaimed_units: Mapping[str, int]  # model -> running units silent for UNRECLAIMED_LEASES leases
    request_error_ratio: Mapping[str, float]  # model -> failed / finished lines, last hour's batches
    waiting_since: Mapping[str, float]  # status (validating, finalizing) -> its oldest batch's stamp
    webhook_endpoints: Mapping[tuple[str, str], int]  # (tenant, state) -> endpoints not removed
    quota_used: Mapping[tuple[str, str], int]  # (tenant, quota) -> use, in the quota's unit
    quota_limit: Mapping[tuple[str, str], int]  # (tenant, quota) -> limit; left out when unlimited
    last_tick: float | None = None  # epoch seconds the dispatcher's tick last completed; None: never


def operations_snapshot(rt: Runtime, now: float, models: frozenset[str]) -> OperationsSnapshot:
    """The gauges above; ``models`` (those /metrics lists) get 0 rather than no series, so a rule
    comparing them with freight_queue_requests finds both."""
    with rt.db.read() as s:
        workers = _engine_workers(s, now, rt.settings.lease_seconds)
        redelivered = {
            model: as_int(n)
            for model, n in s.execute(
                select(WorkUnit.model, func.sum(WorkUnit.attempts - 1))
                .join(Batch, Batch.id == WorkUnit.batch_id)
                .where(Batch.rolled_up_at.is_(None), WorkUnit.attempts > 1)
                .group_by(WorkUnit.model)
            )
        }
        unreclaimed = {
            model: int(n)
            for model, n in s.execute(
                select(WorkUnit.model, func.count())
                .where(
                    WorkUnit.status == UnitStatus.RUNNING,
                    WorkUnit.heartbeat_at < now - UNRECLAIMED_LEASES * rt.settings.lease_seconds,
                )
                .group_by(WorkUnit.model)
            )
        }
        errors = {
            model or NO_MODEL: as_int(failed) / as_int(total)
            for model, failed, total in s.execute(
                select(
                    Batch.model,
                    func.sum(Batch.request_failed),
                    func.sum(Batch.request_completed + Batch.request_failed),
                )
                .where(*in_window(now - ERROR_WINDOW_SECONDS, now + 1))
                .group_by(Batch.model)
            )
            if as_int(total) > 0
        }
        oldest = _oldest_waiting(s)
        endpoints = _webhook_endpoints(s)
        used, limit = _quota_use(s, rt)
        last_tick = tick_clock.last_tick(s)
    return OperationsSnapshot(
        engine_workers={m: len(workers.get(m, ())) for m in sorted(models | set(workers))},
        unit_redeliveries={m: redelivered.get(m, 0) for m in sorted(models | set(redelivered))},
        unreclaimed_units={m: unreclaimed.get(m, 0) for m in sorted(models | set(unreclaimed))},
        request_error_ratio=errors,
        waiting_since=oldest,
        webhook_endpoints=endpoints,
        quota_used=used,
        quota_limit=limit,
        last_tick=last_tick,
    )


def _engine_workers(s: Session, now: float, lease_seconds: float) -> dict[str, set[str]]:
    """model -> the names of its engine workers seen alive: an engine sample in the last
    WORKER_STALE_SECONDS (an idle engine writes none), or a running unit whose heartbeat is within
    the lease (the worker name is the claim token's). A live worker with queued work of its model
    runs it, so 0 here while its requests are queued means no worker is taking them."""
    seen: dict[str, set[str]] = {}
    for sample in live_samples(s, now):
        seen.setdefault(sample.model, set()).add(sample.worker)
    for model, token in s.execute(
        select(WorkUnit.model, WorkUnit.worker).where(
            WorkUnit.status == UnitStatus.RUNNING, WorkUnit.heartbeat_at >= now - lease_seconds
        )
    ):
        holder = holder_of(token)
        seen.setdefault(model, set()).add(holder.worker if holder else str(token))
    return seen


def _oldest_waiting(s: Session) -> dict[str, float]:
    """When the oldest ``validating`` batch was created and the oldest ``finalizing`` one began
    finalizing (epoch seconds); a status no batch is in has no entry. A timestamp, not an age, so
    every scrape of one state reads the same; the rules take ``time() -`` it."""
    oldest_validating = s.scalar(
        select(func.min(Batch.created_at)).where(Batch.status == BatchStatus.VALIDATING.value)
    )
    oldest_finalizing = s.scalar(
        select(func.min(func.coalesce(Batch.finalizing_at, Batch.created_at))).where(
            Batch.status == BatchStatus.FINALIZING.value
        )
    )
    return {
        status: float(since)
        for status, since in (("validating", oldest_validating), ("finalizing", oldest_finalizing))
        if since is not None
    }


def _webhook_endpoints(s: Session) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for tenant, status, reason, n in s.execute(
        select(Tenant.name, WebhookEndpoint.status, WebhookEndpoint.disabled_reason, func.count())
        .join(Tenant, Tenant.id == WebhookEndpoint.tenant_id)
        .where(WebhookEndpoint.removed_at.is_(None))
        .group_by(Tenant.name, WebhookEndpoint.status, WebhookEndpoint.disabled_reason)
    ):
        if status == EndpointStatus.ACTIVE:
            state = "active"
        else:  # Freight disables an endpoint whose deliveries failed for good, with its reason
            state = "disabled_by_tenant" if reason == DISABLED_BY_TENANT else "disabled_failing"
        key = (tenant, state)
        counts[key] = counts.get(key, 0) + int(n)
    for tenant in {t for t, _ in counts}:  # every state of a tenant with endpoints, 0 included
        for state in ENDPOINT_STATES:
            counts.setdefault((tenant, state), 0)
    return dict(sorted(counts.items()))


def _quota_use(s: Session, rt: Runtime) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    """Each active tenant's use of each quota (storage.quotas' own counts, so the gauge is what the
    refusal would compare), and its limit where it has one (0 is unlimited: no limit series)."""
    used: dict[tuple[str, str], int] = {}
    limit: dict[tuple[str, str], int] = {}
    tenants = s.execute(select(Tenant.id, Tenant.name).where(Tenant.disabled_at.is_(None))).all()
    for tenant_id, name in sorted(tenants, key=lambda t: t[1]):
        quota = quota_of(s, rt.settings, tenant_id, lock=False)
        for what, use, cap in (
            ("stored_bytes", stored_bytes(s, tenant_id), quota.stored_bytes),
            ("open_batches", open_batches(s, tenant_id), quota.open_batches),
            ("queued_requests", queued_requests(s, tenant_id), quota.queued_requests),
        ):
            used[(name, what)] = use
            if cap > 0:
                limit[(name, what)] = cap
    return used, limit
