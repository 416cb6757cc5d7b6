"""The dispatcher: applies the planning decisions to the database and the broker.

Run by the periodic ``freight.tick`` task and, for promptness, right after events that free
queue room (validation done, unit done). Safe to run concurrently with itself: every state
change is a compare-and-set, so a unit is queued once and a batch finalized once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import cast

from sqlalchemy import Row, Table, bindparam, case, distinct, exists, func, or_, select, update
from sqlalchemy.orm import Session

from scheduler.deadlines import BatchLoad, Sample, assess, eta_moved, etas, measured_rates
from scheduler.leases import QueuedUnit, RunningUnit, plan_redelivery, plan_requeue
from scheduler.packing import Candidate, plan_packs
from scheduler.sla import AdmissionDecision, admit, eta
from storage import budgets, tick_clock
from storage.db import changed_rows, transaction_lock
from storage.leases import UNIT_LEASE, lease_free
from storage.lifecycle import (
    ACTIVE,
    NO_LIVE_COUNTS,
    finish_if_done,
    lock_free_units,
    move_units,
    move_units_by_id,
    stop_batch,
)
from storage.models import Batch, EngineSample, UnitStatus, ValidationChunk, WorkUnit, new_id
from storage.runtime import Runtime
from storage.status import BatchStatus, ChunkStatus
from workers import webhooks
from workers.arrivals import arriving, more_coming

log = logging.getLogger(__name__)

PACKING_LOCK = "freight.dispatcher.packing"  # with the model's name: see packing_lock
STANDING_DEPTH = 2  # packs per model kept queued where the broker cannot count asks (pack_depth)


@dataclass
class TickReport:
    expired: list[str] = field(default_factory=list)
    redelivered: list[int] = field(default_factory=list)
    given_up: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)  # queued units whose message was lost
    revalidated: list[str] = field(default_factory=list)  # batches whose validation was sent again
    enqueued: list[int] = field(default_factory=list)  # unit ids
    packs: list[str] = field(default_factory=list)
    at_risk: list[str] = field(default_factory=list)
    finalizing: list[str] = field(default_factory=list)
    webhooks: list[int] = field(default_factory=list)  # webhook deliveries sent (first or retry)
    budget_warnings: list[str] = field(default_factory=list)  # tenants whose budget warning was recorded


def tick(rt: Runtime, now: float) -> TickReport:
    report = TickReport()
    expire_overdue(rt, int(now), report)
    redeliver_stale(rt, now, report)
    rates = measured_throughput(rt, now)
    requeue_lost(rt, now, report, rates)
    resend_lost_validations(rt, now, report)
    urgency = assess_deadlines(rt, now, report, rates)
    enqueue_units(rt, now, report, urgency)
    start_finalization(rt, int(now), report)
    with rt.db.write() as s:  # the month's budget warnings, recorded before the deliveries are sent
        report.budget_warnings = budgets.record_warnings(s, now, rt.settings.budget_warning_ratio)
    report.webhooks = webhooks.send_due(rt, now)
    with rt.db.write() as s:  # /metrics' freight_dispatcher_last_tick_timestamp_seconds
        tick_clock.record_tick(s, time.time())
    return report


def measured_throughput(rt: Runtime, now: float, model: str | None = None) -> dict[str, float]:
    """Requests/s per model over the throughput window, from the engines' samples (of ``model``
    only, if given). Summed per worker in the database: a fleet writes a row per worker every
    FREIGHT_SAMPLE_SECONDS (1,000 workers: 120,000 rows in a 10-minute window), and every refill
    asks; each worker's busy-time rate needs only its sums."""
    window = rt.settings.throughput_window_seconds
    where = [EngineSample.started_at >= now - window, EngineSample.seconds > 0]
    if model is not None:
        where.append(EngineSample.model == model)
    with rt.db.read() as s:
        samples = [
            Sample(worker, model_, float(started), float(seconds), int(requests))
            for worker, model_, started, seconds, requests in s.execute(
                select(
                    EngineSample.worker,
                    EngineSample.model,
                    func.min(EngineSample.started_at),
                    func.sum(EngineSample.seconds),
                    func.sum(EngineSample.requests),
                )
                .where(*where)
                .group_by(EngineSample.worker, EngineSample.model)
            )
        ]
    return measured_rates(samples, now, window)


def requeue_lost(rt: Runtime, now: float, report: TickReport, rates: dict[str, float]) -> None:
    """Queued units whose pack message went with a dead worker, or with the broker's data (a
    Redis restart), go back to be packed again.

    As in ``redeliver_stale``, the units to move are locked with SKIP LOCKED and move together: a
    queued unit whose row a worker's claim holds right now is being taken, not lost, so it is left
    alone and the tick never waits for that claim. Waiting for them, one tick of the
    1,000-worker simulation spent 11.7 s in this pass, one UPDATE per unit."""
    settings = rt.settings
    broker_lost = rt.queue.broker_was_reset()
    if broker_lost:
        log.warning(
            "the broker lost its messages (restarted without persistence?); packing queued units again"
        )
        revalidate(rt, now, report)
    with rt.db.write() as s:
        queued = [
            QueuedUnit(*row)
            for row in s.execute(
                select(WorkUnit.id, WorkUnit.model, WorkUnit.enqueued_at).where(
                    WorkUnit.status == UnitStatus.QUEUED
                )
            )
        ]
        stale = plan_requeue(
            queued,
            now,
            rates,
            lease_seconds=settings.lease_seconds,
            # a pack made for an ask is taken at once; one made for an ask that lapsed (its
            # worker died) waits for the next ask, behind at most the standing packs
            depth=settings.queue_depth + 1,
            pack_requests=settings.pack_requests,
            broker_lost=broker_lost,
        )
        free = lock_free_units(s, (u.unit_id for u in stale), WorkUnit.status == UnitStatus.QUEUED)
        if free:
            move_units_by_id(s, free, from_=UnitStatus.QUEUED, to=UnitStatus.PENDING, pack_id=None)
            report.requeued.extend(free)
    if report.requeued:
        log.warning("units %s waited too long in the queue; packing them again", report.requeued)


def resend_lost_validations(rt: Runtime, now: float, report: TickReport) -> None:
    """Send validation again for every ``validating`` batch whose validation lease ran out (the
    worker died mid-way) or was never taken, once a lease has passed since a delivery was last due
    (``validation_due_at``: the last send, or a scheduled retry): its message was lost, or the
    process that created it died between the commit and the send.

    At most one copy a lease: the send is claimed by moving ``validation_due_at`` to ``now`` with a
    compare-and-set, so neither a message waiting behind a long queue nor a long outage multiplies
    into one copy a tick, and two ticks never both send. A copy that meets a live validation finds
    its lease fresh and does nothing.

    A batch validated in chunks (``workers.validation_chunks``) holds its own lease only while it
    sends them and while it merges; meanwhile it counts as lost once none of its pending chunks
    has been sent or held a live lease for a lease: the validation sent then sends those chunks
    again, or merges if they are all done and the last one's message was lost. A batch whose
    chunks all wait for room in its tenant's window (its other batches' chunks hold it) is
    nudged the same way once a lease, and the validation fills the window if room has come (a
    cancelled batch's chunks free room without sending anyone's next)."""
    lease = rt.settings.lease_seconds
    due = func.coalesce(Batch.validation_due_at, Batch.created_at)
    chunk_alive = exists().where(
        ValidationChunk.batch_id == Batch.id,
        ValidationChunk.status == ChunkStatus.PENDING,
        or_(~lease_free(ValidationChunk, "lease_at", now, lease), ValidationChunk.sent_at >= now - lease),
    )
    lost = (
        Batch.status == BatchStatus.VALIDATING,
        lease_free(Batch, "validation_heartbeat_at", now, lease),
        due < now - lease,
        ~chunk_alive,
    )
    with rt.db.read() as s:
        candidates = list(s.scalars(select(Batch.id).where(*lost)).all())
    for batch_id in candidates:
        if batch_id in report.revalidated:  # sent already: the broker had lost its data
            continue
        with rt.db.write() as s:
            claimed = changed_rows(
                s, update(Batch).where(Batch.id == batch_id, *lost).values(validation_due_at=now)
            )
        if claimed:
            rt.queue.validate(batch_id)
            report.revalidated.append(batch_id)
            log.warning(
                "batch %s: neither its validation nor a chunk of it was active for a lease (lost, or"
                " waiting for its tenant's chunk window); sending its validation again",
                batch_id,
                extra={"batch_id": batch_id},
            )


def revalidate(rt: Runtime, now: float, report: TickReport) -> None:
    """Validation messages went with the broker's data too: send them again for every batch still
    ``validating``. Safe if one was in fact running: validation commits only from ``validating``."""
    with rt.db.write() as s:
        waiting = list(s.scalars(select(Batch.id).where(Batch.status == BatchStatus.VALIDATING)))
        s.execute(  # sent now: the lost-validation check waits a lease from here
            update(Batch).where(Batch.id.in_(waiting)).values(validation_due_at=now)
        )
    for batch_id in waiting:
        rt.queue.validate(batch_id)
    report.revalidated.extend(waiting)


def assess_deadlines(
    rt: Runtime, now: float, report: TickReport, rates: dict[str, float]
) -> dict[str, tuple[bool, bool]]:
    """Flag (and unflag) batches at risk from measured throughput; batch id -> (urgent, at_risk).

    Reads without row locks and writes only the rows whose flag changed or whose ETA moved more
    than its jitter (``scheduler.deadlines.eta_moved``), in one executemany: unit records update
    every running batch's row dozens of times a second at fleet scale, and a FOR UPDATE over all of
    them waited for each record in flight (up to 2 s of a tick at 1,000 batches).

    The rows to write are locked first with SKIP LOCKED, and a row a record holds is left to the
    next tick: waiting for it held the rows already written locked, so records of those batches
    queued behind the tick, and under 1,000 simulated workers one tick waited 64 s. Only ticks
    write these two columns and each tick recomputes them, so a skipped row loses nothing; a
    batch newly at risk is reported (and logged) by the tick that writes its flag."""
    settings = rt.settings
    with rt.db.write() as s:
        rows = s.execute(
            select(*LOAD_COLUMNS, Batch.eta_at, Batch.at_risk_since).where(
                Batch.status == BatchStatus.IN_PROGRESS
            )
        ).all()
        loads = [batch_load(row) for row in rows]
        verdicts = assess(loads, rates, now, settings.urgent_slack_seconds)
        finish = etas(loads, rates, now)
        changes = []
        flagged = []
        for row in rows:
            at = finish[row.id]
            eta_at = None if at is None else math.ceil(at)
            since = row.at_risk_since
            if verdicts[row.id][1] and since is None:
                since = int(now)
                flagged.append(row.id)
            elif not verdicts[row.id][1]:
                since = None
            if since != row.at_risk_since or eta_moved(row.eta_at, eta_at, now):
                eta_kept = eta_at if eta_moved(row.eta_at, eta_at, now) else row.eta_at
                changes.append({"batch": row.id, "eta": eta_kept, "since": since})
        if changes:
            # (SQLite has no row locks: there every row is "free", as its one writer holds them all)
            free = set(
                s.scalars(
                    select(Batch.id)
                    .where(
                        Batch.id.in_([c["batch"] for c in changes]), Batch.status == BatchStatus.IN_PROGRESS
                    )
                    .order_by(Batch.id)
                    .with_for_update(skip_locked=True)
                ).all()
            )
            changes = [c for c in changes if c["batch"] in free]
            report.at_risk.extend(b for b in flagged if b in free)
        if changes:
            table = cast(Table, Batch.__table__)  # Core: an executemany, not the ORM's bulk update by key
            s.execute(
                update(table)
                .where(table.c.id == bindparam("batch"), table.c.status == BatchStatus.IN_PROGRESS)
                .values(eta_at=bindparam("eta"), at_risk_since=bindparam("since")),
                changes,
            )
    for batch_id in report.at_risk:
        log.warning(
            "batch %s is at risk of missing its deadline at the measured throughput",
            batch_id,
            extra={"batch_id": batch_id},
        )
    return verdicts


# what batch_load reads of a batch row
LOAD_COLUMNS = (
    Batch.id,
    Batch.model,
    Batch.expires_at,
    Batch.request_total,
    Batch.request_completed,
    Batch.request_failed,
)


def batch_load(row: Row) -> BatchLoad:
    """What is left of an in-progress batch, from a row that starts with ``LOAD_COLUMNS``. Read by
    position: by name, a row's columns cost ~25 us each, more than the rest of a refill's Python
    here (every batch of the model, at every unit recorded and pack taken)."""
    batch_id, model, expires_at, total, completed, failed = row[: len(LOAD_COLUMNS)]
    return BatchLoad(batch_id, model or "", expires_at, max(0, total - completed - failed))


def current_urgency(rt: Runtime, now: float, model: str | None = None) -> dict[str, tuple[bool, bool]]:
    """The tick's verdicts (batch id -> (urgent, at_risk)) without its writes, for a refill between
    ticks: most packs are made then (a unit done, a pack taken), and a pack made from the at-risk
    flags alone would drop urgency for whoever it was due to, and its share cap with it. A model's
    verdicts depend on its own batches and samples only, so a refill of one model reads those."""
    rates = measured_throughput(rt, now, model)
    where = [Batch.status == BatchStatus.IN_PROGRESS]
    if model is not None:
        where.append(Batch.model == model)
    with rt.db.read() as s:
        loads = [batch_load(row) for row in s.execute(select(*LOAD_COLUMNS).where(*where))]
    return assess(loads, rates, now, rt.settings.urgent_slack_seconds)


def admit_batch(
    rt: Runtime, s: Session, batch: Batch, model: str, requests: int, now: float, rates: dict[str, float]
) -> AdmissionDecision:
    """Admission control for a batch that just passed validation (so its model and size are known):
    its ETA behind every batch of the model due no later than it, at the measured rate, against its
    deadline, decided by ``FREIGHT_ADMISSION``. Sets the batch's first ETA."""
    ahead = s.scalar(
        select(
            func.coalesce(func.sum(Batch.request_total - Batch.request_completed - Batch.request_failed), 0)
        ).where(
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.model == model,
            Batch.expires_at <= batch.expires_at,
            Batch.id != batch.id,
        )
    )
    finish = eta(requests, int(ahead or 0), rates.get(model), now)
    batch.eta_at = None if finish is None else math.ceil(finish)
    return admit(finish, batch.expires_at, rt.settings.admission, batch.completion_window)


def expire_overdue(rt: Runtime, now: int, report: TickReport) -> None:
    with rt.db.write() as s:
        overdue = s.scalars(
            select(Batch)
            .where(
                Batch.status.in_([BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS]), Batch.expires_at <= now
            )
            .with_for_update()
        ).all()
        for batch in overdue:
            stop_batch(s, batch, BatchStatus.EXPIRED, now)
            report.expired.append(batch.id)
    for batch_id in report.expired:
        log.warning("batch %s expired", batch_id, extra={"batch_id": batch_id})


def redeliver_stale(rt: Runtime, now: float, report: TickReport) -> None:
    """Running units whose worker stopped heartbeating for a lease go back to pending (or fail
    after ``max_unit_attempts``).

    The stale units are locked with SKIP LOCKED and their heartbeat read again under the lock: a
    unit whose row a heartbeat or a record holds right now has a live worker, so it is left
    alone, and the tick never waits for one. Waiting for them, one tick of the 1,000-worker
    simulation spent 59 s in this pass (3,379 units, each behind a fleet transaction). The units
    to run again move in one statement per ``IDS_PER_STATEMENT`` of them (one per unit took 0.75 s
    for 1,310 units)."""
    lease = rt.settings.lease_seconds
    with rt.db.write() as s:
        rows = s.execute(
            select(WorkUnit.id, WorkUnit.model, WorkUnit.heartbeat_at, WorkUnit.attempts).where(
                WorkUnit.status == UnitStatus.RUNNING
            )
        ).all()
        retry, give_up = plan_redelivery(
            (RunningUnit(*row) for row in rows), now, lease, rt.settings.max_unit_attempts
        )
        if retry or give_up:
            # the heartbeat re-read under the lock (on SQLite, under its one writer's)
            still_stale = set(
                lock_free_units(
                    s,
                    (u.unit_id for u in (*retry, *give_up)),
                    WorkUnit.status == UnitStatus.RUNNING,
                    or_(WorkUnit.heartbeat_at.is_(None), WorkUnit.heartbeat_at < now - lease),
                )
            )
            retry = [u for u in retry if u.unit_id in still_stale]
            give_up = [u for u in give_up if u.unit_id in still_stale]
        if retry:  # back to pending, in a few statements: the next packing pass queues them again
            ids = sorted(u.unit_id for u in retry)
            # their workers' leases end over their heads: their heartbeats stopped
            moved = UNIT_LEASE.revoke(
                s,
                ids,
                from_=UnitStatus.RUNNING,
                to=UnitStatus.PENDING,
                # the lost attempt's live counts go too: its results were never recorded
                pack_id=None,
                **NO_LIVE_COUNTS,
            )
            # every one moves: each is still running under this transaction's row locks (on
            # SQLite, under its one writer's lock, taken at BEGIN IMMEDIATE)
            if moved != len(ids):
                log.error("redelivery moved %d of %d stale units", moved, len(ids))
            report.redelivered.extend(ids)
        for unit in give_up:
            move_units(
                s,
                WorkUnit.id == unit.unit_id,
                from_=UnitStatus.RUNNING,
                to=UnitStatus.FAILED,
                finished_at=now,
                **NO_LIVE_COUNTS,
                note=f"worker lost {unit.attempts} times",
            )
            report.given_up.append(unit.unit_id)
    for unit_id in report.redelivered:
        log.warning("unit %s lost its worker; it will be packed again", unit_id)


@dataclass(frozen=True)
class InFlight:
    """Work queued or running (``WEIGHT``: a unit's work, its requests when it has none recorded),
    as a packing pass of one model weighs it: per tenant on every model (the urgent share's
    measure), per tenant on the model (its fair share), per batch of the model (a tenant's
    batches' turns)."""

    tenants: dict[str, int]
    model_tenants: dict[str, int]
    batches: dict[str, int]


# a unit's weight in the fair shares, in SQL: scheduler.packing.Candidate.weight
WEIGHT = case((WorkUnit.work > 0, WorkUnit.work), else_=WorkUnit.n_requests)


def in_flight(s: Session, model: str, with_tenants: bool) -> InFlight:
    """Grouped reads over the units in flight: of ``model`` always; of every model only
    ``with_tenants`` (some candidate is urgent, so the urgent share's cap applies)."""
    moving = WorkUnit.status.in_([UnitStatus.QUEUED, UnitStatus.RUNNING])
    model_tenants: dict[str, int] = defaultdict(int)
    batches: dict[str, int] = {}
    for tenant, batch_id, requests in s.execute(
        select(Batch.tenant_id, WorkUnit.batch_id, func.sum(WEIGHT))
        .join(Batch, Batch.id == WorkUnit.batch_id)
        .where(moving, WorkUnit.model == model)
        .group_by(Batch.tenant_id, WorkUnit.batch_id)
    ):
        model_tenants[tenant] += int(requests)
        batches[batch_id] = int(requests)
    tenants: dict[str, int] = {}
    if with_tenants:
        tenants = {
            tenant: int(requests)
            for tenant, requests in s.execute(
                select(Batch.tenant_id, func.sum(WEIGHT))
                .join(Batch, Batch.id == WorkUnit.batch_id)
                .where(moving)
                .group_by(Batch.tenant_id)
            )
        }
    return InFlight(tenants, dict(model_tenants), batches)


def packing_lock(model: str) -> str:
    """The storage.db.transaction_lock of one model's packing passes: one at a time per model."""
    return f"{PACKING_LOCK}:{model}"


def enqueue_units(
    rt: Runtime,
    now: float,
    report: TickReport,
    urgency: dict[str, tuple[bool, bool]] | None = None,
    model: str | None = None,
) -> None:
    """Make the packs each model's engine workers have asked for (``queue_depth`` more, 0 by
    default), and send them: ``queue_depth`` of ``scheduler.packing`` is the model's `pack_depth`.

    Why on ask, not a standing queue: a pack waiting in the broker waits for a worker to finish
    feeding the one before. With two packs standing per model, one queued behind the other waited
    for two asks: at a model's ~1 ask a second in the 1,000-worker simulation, 6.5 s at the 99th
    percentile from being packed to being claimed. A pack made for a worker that waits on the queue
    is claimed milliseconds after its commit, and the decision of what it holds is made with the
    fleet's state of that moment. The packing pass this costs the asking worker (~0.2 s at the
    median at 10M requests) is hidden by its feed's look-ahead (``PackRunner``).

    ``urgency`` comes from this tick's `assess_deadlines`; callers outside the tick (a unit just
    finished, a batch just validated) pass none and get the same verdicts from `current_urgency`.
    ``model``: refill that model's queue only, the one a finished unit or a taken pack made room
    in. An engine fleet refills after every unit and pack (1,000 workers: dozens a second), so such
    a refill first checks that its queue has room, and then reads that model's units alone.

    Each model is packed in a transaction of its own under its own lock (``packing_lock``): the
    units of two models never overlap, so their passes cannot deadlock, and a fleet's refills of
    ten models no longer queue behind one lock (under 1,000 simulated workers most refills found
    the single lock taken and left their queue empty: workers idled 21 s at the median). A pass,
    the tick's too, that finds its model's lock taken leaves that queue to the pass under way
    (and to the next refill or tick): the tick waiting for it took up to 2.9 s of a tick.
    """
    if model is not None and not queue_has_room(rt, model, now):
        return
    if urgency is None:
        urgency = current_urgency(rt, now, model)
    with rt.db.read() as s:
        if model is None:
            models = sorted(
                m
                for m in s.scalars(select(Batch.model).where(Batch.status.in_(ACTIVE)).distinct()).all()
                if m is not None
            )
        else:
            models = [model]
    for name in models:
        pack_model(rt, now, report, urgency, name)


def pack_model(
    rt: Runtime,
    now: float,
    report: TickReport,
    urgency: dict[str, tuple[bool, bool]],
    model: str,
) -> None:
    """One packing pass of one model's queue, then the packs sent after its commit."""
    settings = rt.settings
    sends: list[tuple[str, list[int], bool, list[int], float | None]] = []
    with rt.db.write() as s:
        # one packing pass of a model at a time: concurrent passes planned the same pending units
        # and locked them in different orders (PostgreSQL failed one of each deadlocked pair)
        if not transaction_lock(s, packing_lock(model), wait=False):
            return
        queued = int(
            s.scalar(
                select(func.count(distinct(WorkUnit.pack_id))).where(
                    WorkUnit.status == UnitStatus.QUEUED, WorkUnit.model == model
                )
            )
            or 0
        )
        # the asks after the queued packs: a worker withdraws its ask before it claims its pack,
        # so a pack this count missed (claimed) has its ask gone from the next read too. Read the
        # other way round, a pass counted such an ask and made a pack nobody waited for, which
        # stood in the queue until the next ask (the simulation's runnable-to-claim tail). This
        # order can miss a pack for an ask (its pack was counted, not yet claimed): the next
        # refill or tick makes it, inside the asking worker's look-ahead.
        depth = pack_depth(rt, model, now)
        if queued >= depth:
            return
        # the first few pending units of every running batch: enough to fill the room left (a
        # worker's ask mostly makes room for one pack, and reads that many rows)
        room = depth - queued
        per_batch = math.ceil(room * settings.pack_requests / settings.unit_size) + 1
        rank = func.row_number().over(partition_by=WorkUnit.batch_id, order_by=WorkUnit.seq).label("rank")
        pending = (
            select(
                WorkUnit.id,
                WorkUnit.batch_id,
                WorkUnit.seq,
                WorkUnit.n_requests,
                WorkUnit.prefix_key,
                WorkUnit.work,
                rank,
            )
            .where(WorkUnit.status == UnitStatus.PENDING, WorkUnit.model == model)
            .subquery()
        )
        rows = s.execute(
            select(
                pending,
                Batch.tenant_id,
                Batch.expires_at,
                Batch.priority,
                Batch.created_at,
                Batch.at_risk_since,
            )
            .join(Batch, Batch.id == pending.c.batch_id)
            .where(Batch.status.in_(ACTIVE), pending.c.rank <= per_batch)  # validating: early slices
        ).all()
        # rows unpacked by position: a tick at 10M requests reads ~9,000 of them, and access by
        # name on SQLAlchemy rows cost ~25 us a row (0.23 s of a 0.5 s tick)
        candidates = [
            Candidate(
                unit_id=unit_id,
                model=model,
                batch_id=batch_id,
                tenant_id=tenant_id,
                deadline=expires_at,
                priority=priority,
                created_at=created_at,
                seq=seq,
                n_requests=n_requests,
                prefix_key=bytes(prefix_key or b""),
                domain=settings.cache_domain(tenant_id),
                urgent=urgency[batch_id][0] if urgency and batch_id in urgency else at_risk_since is not None,
                work=work,
            )
            for (
                unit_id,
                batch_id,
                seq,
                n_requests,
                prefix_key,
                work,
                _rank,
                tenant_id,
                expires_at,
                priority,
                created_at,
                at_risk_since,
            ) in rows
        ]
        if not candidates:
            return
        loads = in_flight(s, model, with_tenants=any(c.urgent for c in candidates))
        packs = plan_packs(
            candidates,
            {model: queued},
            depth=depth,
            pack_requests=settings.pack_requests,
            tenant_load=loads.tenants,
            urgent_share=settings.urgent_share,
            model_load={model: loads.model_tenants},
            batch_load=loads.batches,
        )
        # work on its way (workers/arrivals.py), read after the candidates: a batch that concluded
        # between the two reads is in this pack, and read before them it was counted as still
        # validating (a pack said more would come when none would, and the engine waited for it)
        coming = arriving(s, settings, now)
        more = more_coming(coming, model, {c.domain for c in candidates})
        # the newest batch that may be of this model (one validating may be of any): an idle
        # worker's settle window counts from its creation (scheduler.feed_order.gather_deadline)
        newest_batch_at = s.scalar(
            select(func.max(Batch.submitted_at)).where(
                or_(Batch.model == model, Batch.model.is_(None)),
                Batch.status.in_((BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)),
            )
        )
        for pack in packs:
            pack_id = new_id("pack_")
            move_units(
                s,
                WorkUnit.id.in_(pack.unit_ids),
                from_=UnitStatus.PENDING,
                to=UnitStatus.QUEUED,
                enqueued_at=now,
                pack_id=pack_id,
            )
            # a concurrent pass may have taken some of them: send only what this one queued
            taken = list(s.scalars(select(WorkUnit.id).where(WorkUnit.pack_id == pack_id)).all())
            if taken:
                urgent = [u for u in taken if u in set(pack.urgent)]
                sends.append((pack_id, taken, more, urgent, newest_batch_at))
    # after the commit: a task never refers to a row state that might roll back
    for pack_id, unit_ids, more, urgent, newest in sends:
        rt.queue.run_pack(pack_id, model, unit_ids, more, urgent, newest)
        report.packs.append(pack_id)
        report.enqueued.extend(unit_ids)


def pack_depth(rt: Runtime, model: str, now: float) -> int:
    """Packs of ``model`` to have queued now: one per engine worker waiting for a pack (its ask not
    lapsed), plus ``queue_depth``. On a broker that cannot count asks (not Redis), a standing queue
    of ``STANDING_DEPTH`` packs as before asks existed."""
    asks = rt.queue.asks.count(model, now)
    return rt.settings.queue_depth + (STANDING_DEPTH if asks is None else asks)


def queue_has_room(rt: Runtime, model: str, now: float) -> bool:
    """Fewer packs of ``model`` wait in its broker queue than ``pack_depth`` (a sorted-set count
    and an index lookup: a fleet's every finished unit asks)."""
    with rt.db.read() as s:
        packs = s.scalar(
            select(func.count(distinct(WorkUnit.pack_id))).where(
                WorkUnit.status == UnitStatus.QUEUED, WorkUnit.model == model
            )
        )
    return int(packs or 0) < pack_depth(rt, model, now)  # the asks read second: see pack_model


def start_finalization(rt: Runtime, now: int, report: TickReport) -> None:
    """Batches whose units have all finished go to finalization (``finish_if_done`` checks each
    again under its row lock). Found in a fixed number of statements, not one per open batch (a
    tick with many batches running found almost all of them busy, a query each), and without a
    correlated NOT EXISTS: on PostgreSQL's generic plan it became a nested loop over every open
    batch times every unfinished unit (1.2 s of a tick at 1,000 batches and 40,000 units). The
    batches with unfinished units are one linear read of the units instead."""
    open_batch = (
        Batch.status.in_([BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING]),
        # a finalizer holding a fresh lease is already on it; do not send it another
        or_(
            Batch.finalizer_heartbeat_at.is_(None),
            Batch.finalizer_heartbeat_at < now - rt.settings.lease_seconds,
        ),
    )
    with rt.db.write() as s:
        busy = set(
            s.scalars(
                select(WorkUnit.batch_id).where(WorkUnit.status.not_in(UnitStatus.FINISHED)).distinct()
            ).all()
        )
        ids = [b for b in s.scalars(select(Batch.id).where(*open_batch)).all() if b not in busy]
        candidates = (
            s.scalars(select(Batch).where(Batch.id.in_(ids), *open_batch).with_for_update()).all()
            if ids
            else []
        )
        ready = [b.id for b in candidates if finish_if_done(s, b, now)]
    for batch_id in ready:
        rt.queue.finalize(batch_id)
        report.finalizing.append(batch_id)
