"""The periodic cleanup (beat task ``freight.cleanup``, every ``FREIGHT_CLEANUP_SECONDS``): what
tenants stored and the platform recorded does not grow without end.

Five steps, each bounded per pass (the sessions by one lifetime of sign-ins) (``PASS_ROWS``) so one pass is short and a backlog drains over
several:

- expired files (``files.expires_at`` passed) are deleted, bytes first; a file that is the input
  of a batch still running waits for it to end;
- a final batch's Parquet shards and unit results are deleted ``FREIGHT_BATCH_DATA_RETENTION_SECONDS``
  after it ended, or once its input file is gone (they hold that file's prompts); its rows stay;
- ``engine_samples`` rows older than ``FREIGHT_SAMPLE_RETENTION_SECONDS`` are added to
  ``engine_sample_totals`` and deleted in one transaction, so the counters of ``/metrics`` (the
  totals plus the rows kept) never move backwards;
- final batches not yet in the rollup /metrics reads (made final while a unit still ran, or
  written by an older release) are added once their units have finished (``storage/rollup.py``);
- console sessions past their lifetime are deleted (they were already refused);
- webhook deliveries that ended (delivered or failed) ``FREIGHT_FILE_RETENTION_SECONDS`` ago are
  deleted (0: kept), so the delivery log lives as long as a batch's result files;
- dry-run estimates (``workers/estimates.py``): one still ``validating`` a
  ``FREIGHT_VALIDATION_TIME_LIMIT_SECONDS`` after it was asked for lost its task (a message lost
  with the broker's data, a worker killed past the limit) and is failed, saying so, so no estimate
  stays ``validating`` for ever (the tenant's count of waiting estimates stops counting it at the
  same age); finished ones are deleted ``FREIGHT_ESTIMATE_RETENTION_SECONDS`` (a day) after they
  finished (0: kept);
- ``Idempotency-Key`` rows (``storage/idempotency.py``) are deleted once past their 24 hours
  (``KEY_SECONDS``): from then on the key is as if never sent anyway.

Uploads (``/v1/uploads``) still pending an hour after their creation become ``expired``, and the
parts of uploads no longer pending (expired, cancelled, or completed where the request could not
delete them) are deleted (``storage.retention``), PASS_ROWS a pass.

Any step may run twice at once (two beats, a manual ``freight cleanup``): deletes are idempotent,
and a sample row is added to the totals by the transaction that deleted it, so by one only.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, exists, or_, select, update
from sqlalchemy.orm import aliased

from storage.idempotency import prune as prune_idempotency_keys
from storage.lifecycle import move_estimates
from storage.models import (
    Batch,
    ConsoleSession,
    EngineSample,
    EngineSampleTotal,
    Estimate,
    StoredFile,
    Upload,
    WebhookDelivery,
)
from storage.quotas import OPEN_STATUSES
from storage.retention import delete_file_objects, expire_uploads, purge_batch_data, purge_upload_parts
from storage.rollup import roll_up_stragglers
from storage.runtime import Runtime
from storage.status import BatchStatus, DeliveryStatus, EstimateStatus, UploadStatus
from workers.task_policy import one_error

log = logging.getLogger(__name__)

PASS_ROWS = 500  # files, batches or sample rows handled per step and pass
SUMMED = ("seconds", "cost_micros", "prompt_tokens", "cached_tokens", "output_tokens", "requests")


@dataclass
class CleanupReport:
    files_expired: list[str] = field(default_factory=list)
    batches_purged: list[str] = field(default_factory=list)
    objects_deleted: int = 0
    samples_pruned: int = 0
    batches_rolled_up: int = 0
    sessions_ended: int = 0
    deliveries_pruned: int = 0
    estimates_lost: int = 0
    estimates_pruned: int = 0
    uploads_expired: list[str] = field(default_factory=list)
    uploads_purged: list[str] = field(default_factory=list)
    keys_pruned: int = 0


def run(rt: Runtime, now: float) -> CleanupReport:
    report = CleanupReport()
    expire_files(rt, int(now), report)
    purge_batches(rt, int(now), report)
    prune_samples(rt, now, report)
    with rt.db.write() as s:
        report.batches_rolled_up = roll_up_stragglers(s, int(now), PASS_ROWS)
    end_sessions(rt, int(now), report)
    prune_deliveries(rt, int(now), report)
    end_estimates(rt, int(now), report)
    end_uploads(rt, int(now), report)
    with rt.db.write() as s:
        report.keys_pruned = prune_idempotency_keys(s, now, PASS_ROWS)
    if report.files_expired or report.batches_purged or report.samples_pruned:
        log.info(
            "cleanup: %d files expired, %d batches' data purged (%d objects), %d engine samples pruned",
            len(report.files_expired),
            len(report.batches_purged),
            report.objects_deleted,
            report.samples_pruned,
        )
    return report


def end_sessions(rt: Runtime, now: int, report: CleanupReport) -> None:
    """Console sessions past their lifetime: already refused at sign-in checks, their rows go
    here, so the table holds about one FREIGHT_SESSION_SECONDS of sign-ins."""
    with rt.db.write() as s:
        ended = s.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
        report.sessions_ended = int(ended.rowcount or 0)  # type: ignore[attr-defined]


def prune_deliveries(rt: Runtime, now: int, report: CleanupReport) -> None:
    """Webhook deliveries that ended a retention ago (PASS_ROWS a pass); pending ones stay."""
    report.deliveries_pruned = _prune_ended(
        rt,
        WebhookDelivery.id,
        WebhookDelivery.status != DeliveryStatus.PENDING,
        WebhookDelivery.status_at < now - rt.settings.file_retention_seconds,
    )


def _prune_ended(rt: Runtime, id_column: Any, *ended: Any, retention_seconds: int | None = None) -> int:
    """Delete up to PASS_ROWS rows matching ``ended`` (rows that ended a retention ago, by default
    FREIGHT_FILE_RETENTION_SECONDS; 0 keeps them); how many went."""
    retention = rt.settings.file_retention_seconds if retention_seconds is None else retention_seconds
    if retention <= 0:
        return 0
    with rt.db.write() as s:
        old = s.scalars(select(id_column).where(*ended).limit(PASS_ROWS)).all()
        if old:
            s.execute(delete(id_column.class_).where(id_column.in_(old)))
    return len(old)


def end_estimates(rt: Runtime, now: int, report: CleanupReport) -> None:
    """Estimates whose task was lost fail; finished ones a retention old go (PASS_ROWS each a pass)."""
    lost_before = now - rt.settings.validation_time_limit_seconds
    lost_error = one_error(
        "the estimate was not made within FREIGHT_VALIDATION_TIME_LIMIT_SECONDS "
        f"({rt.settings.validation_time_limit_seconds} s): its task was lost or stopped; ask again",
        code="estimate_lost",
    )
    with rt.db.write() as s:
        lost = s.scalars(
            select(Estimate.id)
            .where(Estimate.status == EstimateStatus.VALIDATING, Estimate.created_at < lost_before)
            .limit(PASS_ROWS)
        ).all()
        if lost:  # a compare-and-set: a task that finished meanwhile keeps its answer
            move_estimates(s, Estimate.id.in_(lost), to=EstimateStatus.FAILED, now=now, errors=lost_error)
    report.estimates_lost = len(lost)
    if lost:
        log.warning("cleanup: %d estimates lost their task and were failed", len(lost))
    report.estimates_pruned = _prune_ended(
        rt,
        Estimate.id,
        Estimate.status != EstimateStatus.VALIDATING,
        Estimate.finished_at < now - rt.settings.estimate_retention_seconds,
        retention_seconds=rt.settings.estimate_retention_seconds,
    )


def end_uploads(rt: Runtime, now: int, report: CleanupReport) -> None:
    """Pending uploads past their hour expire; the parts of those that ended are deleted."""
    report.uploads_expired = expire_uploads(rt, now, PASS_ROWS)
    with rt.db.read() as s:
        ended = s.execute(
            select(Upload.id, Upload.tenant_id)
            .where(Upload.purged_at.is_(None), Upload.status != UploadStatus.PENDING)
            .limit(PASS_ROWS)
        ).all()
    for upload_id, tenant_id in ended:
        report.objects_deleted += purge_upload_parts(rt, tenant_id, upload_id, now)
        report.uploads_purged.append(upload_id)


def expire_files(rt: Runtime, now: int, report: CleanupReport) -> None:
    running = exists().where(Batch.input_file_id == StoredFile.id, Batch.status.in_(OPEN_STATUSES))
    with rt.db.read() as s:
        due = list(
            s.scalars(
                select(StoredFile)
                .where(StoredFile.deleted_at.is_(None), StoredFile.expires_at <= now, ~running)
                .order_by(StoredFile.expires_at)
                .limit(PASS_ROWS)
            )
        )
    for record in due:
        delete_file_objects(rt, record)  # bytes first: a row marked deleted never has them left
        with rt.db.write() as s:
            s.execute(
                update(StoredFile)
                .where(StoredFile.id == record.id, StoredFile.deleted_at.is_(None))
                .values(deleted_at=now)
            )
        report.files_expired.append(record.id)
        report.objects_deleted += 1


def purge_batches(rt: Runtime, now: int, report: CleanupReport) -> None:
    """Final batches past retention, or whose input file is gone (deleted or expired above)."""
    source = aliased(StoredFile)
    input_gone = exists().where(source.id == Batch.input_file_id, source.deleted_at.is_not(None))
    with rt.db.read() as s:
        due = list(
            s.scalars(
                select(Batch.id)
                .where(
                    Batch.purged_at.is_(None),
                    Batch.status.in_(BatchStatus.FINAL),
                    or_(now - rt.settings.batch_data_retention_seconds >= Batch.finished_at, input_gone),
                )
                .limit(PASS_ROWS)
            )
        )
    for batch_id in due:
        report.objects_deleted += purge_batch_data(rt, batch_id, now)
        report.batches_purged.append(batch_id)


def prune_samples(rt: Runtime, now: float, report: CleanupReport) -> None:
    """Fold samples older than the retention into the totals, ``PASS_ROWS`` at a time. The rows
    a transaction adds are the ones its own DELETE … RETURNING removed: a concurrent pass that
    picked the same rows deletes none of them and adds nothing."""
    cutoff = now - rt.settings.sample_retention_seconds
    while True:
        with rt.db.write() as s:
            oldest = (
                select(EngineSample.id)
                .where(EngineSample.started_at < cutoff)
                .order_by(EngineSample.started_at)
                .limit(PASS_ROWS)
            )
            rows = s.execute(
                delete(EngineSample)
                .where(EngineSample.id.in_(oldest.scalar_subquery()))
                .returning(
                    EngineSample.worker,
                    EngineSample.model,
                    EngineSample.preemptions,
                    *(getattr(EngineSample, c) for c in SUMMED),
                )
                .execution_options(synchronize_session=False)
            ).all()
            sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0] * (len(SUMMED) + 1))
            # preemptions stay NULL until a pruned row counted them (a core in its own process does not)
            preemptions: dict[tuple[str, str], int] = {}
            for worker, model, preempted, *values in rows:
                acc = sums[(worker, model)]
                acc[0] += 1
                for i, value in enumerate(values, 1):
                    acc[i] += value or 0
                if preempted is not None:
                    preemptions[(worker, model)] = preemptions.get((worker, model), 0) + preempted
            for (worker, model), acc in sums.items():
                total = s.get(EngineSampleTotal, (worker, model), with_for_update=True)
                if total is None:
                    total = EngineSampleTotal(
                        worker=worker, model=model, samples=0, **dict.fromkeys(SUMMED, 0)
                    )
                    s.add(total)
                total.samples += int(acc[0])
                for name, value in zip(SUMMED, acc[1:], strict=True):
                    setattr(total, name, getattr(total, name) + (value if name == "seconds" else int(value)))
                if (worker, model) in preemptions:
                    total.preemptions = (total.preemptions or 0) + preemptions[(worker, model)]
        report.samples_pruned += len(rows)
        if len(rows) < PASS_ROWS:
            return
