"""The job page's event timeline, a stopped job's progress split and the throughput chart's live
part, through Flask's test client on SQLite and PostgreSQL (api/services/job_events.py and
api/services/console.py). No worker runs: units are written as the workers write them."""

from __future__ import annotations

import re

from sqlalchemy import event, insert

from api.services import job_events
from storage.models import Batch, UnitStatus, WorkUnit
from tests.api.test_console import alpha, api_batch, html, keys  # noqa: F401 (fixtures)
from tests.conftest import now

T0 = 1_800_000_000  # a fixed start, so every offset below is exact


def unit(batch_id: str, seq: int, n: int = 10, **values) -> dict:
    row = dict(
        batch_id=batch_id, seq=seq, model="demo", shard_key=f"k{seq}", first_line=seq * n, n_requests=n
    )
    return {**row, **values}


def events_of(page: str) -> list[tuple[str, str]]:
    """(kind, text) of every timeline line, in page order."""
    block = page[page.index('id="timeline"') : page.index("</ol>", page.index('id="timeline"'))]
    lines = re.findall(r'<li class="ev-[a-z_]+" data-kind="([a-z_]+)">(.*?)</li>', block, re.S)
    return [(kind, re.sub(r"<[^>]+>", " ", text)) for kind, text in lines]


def test_a_cancelled_jobs_timeline_and_progress(app, runtime, keys, alpha):  # noqa: F811
    """Created, validated, units dispatched, a unit restarted after its worker was lost, one given
    up, cancel requested, the rest skipped, finalized; the bar splits completed, cancelled, failed."""
    batch = api_batch(app, keys["a"])
    with runtime.db.write() as s:
        b = s.get(Batch, batch["id"])
        b.created_at, b.in_progress_at, b.cancelling_at, b.cancelled_at = T0, T0 + 5, T0 + 300, T0 + 320
        b.status, b.model, b.request_total = "cancelled", "demo", 40
        b.request_completed, b.request_failed = 13, 27  # finalization: failed = total - completed
        b.expires_at = T0 + 86400
        s.execute(insert(WorkUnit), [
            # enqueued 0.4 s apart: one second on the page, so no "+10s to +10s"
            unit(b.id, 0, enqueued_at=T0 + 10.4, started_at=T0 + 11, finished_at=T0 + 100, status=UnitStatus.DONE, completed=10),
            # restarted after a lost worker, then cut short by the cancel: 7 of its 10 never ran
            unit(b.id, 1, enqueued_at=T0 + 10, started_at=T0 + 200, finished_at=T0 + 310, status=UnitStatus.DONE,
                 attempts=2, completed=3, failed=7),
            unit(b.id, 2, enqueued_at=T0 + 10, finished_at=T0 + 250, status=UnitStatus.FAILED, attempts=3,
                 note="worker lost 3 times"),
            unit(b.id, 3, enqueued_at=T0 + 10, finished_at=T0 + 300, status=UnitStatus.SKIPPED),
        ])  # fmt: skip
    page = html(alpha.get(f"/console/jobs/{batch['id']}"))
    events = events_of(page)
    kinds = [k for k, _ in events]
    assert kinds == [
        "created", "validated", "dispatched", "finished", "restarted", "gave_up", "cancel", "skipped",
        "finished", "final",
    ], events  # fmt: skip
    text = dict(zip(kinds, (t for _, t in events), strict=False))
    assert "units 1-4 dispatched" in text["dispatched"] and "+10s" in text["dispatched"]
    assert "to +" not in text["dispatched"]  # all four at once
    finished = [x for k, x in events if k == "finished"]
    assert "unit 1 finished" in finished[0] and "+100s" in finished[0] and "to +" not in finished[0]
    assert "unit 2 finished" in finished[1] and "+310s" in finished[1]
    assert "40 requests in 4 work units" in text["validated"]
    assert "unit 2 restarted after a lost worker" in text["restarted"]
    assert "unit 3 failed" in text["gave_up"] and "worker lost 3 times (1)" in text["gave_up"]
    assert "cancel requested" in text["cancel"] and "+300s" in text["cancel"]
    assert "unit 4 skipped (never ran)" in text["skipped"]
    assert "finalized: cancelled" in text["final"]
    # what finished before the cancel: 13 completed, 17 cancelled (unit 4's 10 and unit 2's 7 cut
    # short), 10 failed (unit 3, lost three times)
    assert 'id="count-completed">13<' in page and 'id="count-stopped">17<' in page
    assert 'id="count-failed">10<' in page
    listing = html(alpha.get("/console/jobs"))
    row = listing[listing.index(f'id="job-{batch["id"]}"') :].split("</tr>")[0]
    assert 'data-completed="13" data-stopped="17" data-failed="10"' in row
    assert re.search(
        r'class="n-completed">13</span> completed · <span class="n-stopped">17</span> cancelled', row
    )
    assert "<progress" not in row  # the split bar instead


def test_a_timeline_of_thousands_of_units_is_capped_and_read_in_buckets(app, runtime, keys, alpha):  # noqa: F811
    """3,000 units over ten hours: the database groups them per bucket (never a row per unit) and
    the page shows at most MAX_EVENTS lines, the first and the latest, saying how many it left out."""
    batch = api_batch(app, keys["a"])
    span = 36_000
    with runtime.db.write() as s:
        b = s.get(Batch, batch["id"])
        b.created_at, b.in_progress_at, b.completed_at, b.finalizing_at = T0, T0 + 5, T0 + 5 + span, T0 + span
        b.status, b.model, b.request_total, b.request_completed = "completed", "demo", 30_000, 30_000
        rows = []
        for seq in range(3000):
            at = T0 + 10 + seq * (span - 100) / 3000
            rows.append(unit(b.id, seq, enqueued_at=at, started_at=at + 5, finished_at=at + 65,
                             status=UnitStatus.DONE, completed=10, attempts=2 if seq % 10 == 0 else 1))  # fmt: skip
        s.execute(insert(WorkUnit), rows)
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    with runtime.db.read() as s:
        b = s.get(Batch, batch["id"])
        engine = s.get_bind()
        event.listen(engine, "after_cursor_execute", record)
        try:
            t = job_events.timeline(s, b, float(now()))
        finally:
            event.remove(engine, "after_cursor_execute", record)
    on_units = [x for x in statements if "work_units" in x]
    # every read of the units is an aggregate of this batch's: none returns a row per unit
    assert on_units and all(
        "work_units.batch_id =" in x and ("GROUP BY" in x or "count(" in x) for x in on_units
    )
    assert t.bucket_seconds == 1200  # ten hours in at most 30 buckets of whole minutes
    assert len(t.events) == job_events.MAX_EVENTS
    # created + validated + 3 unit kinds x ~30 buckets + finalizing + final, less those shown
    assert 80 <= len(t.events) + t.left_out <= 4 + 3 * (job_events.MAX_BUCKETS + 1)
    assert t.events[0].kind == "created" and t.events[-1].kind == "final"
    # a bucket of 20 minutes holds 100 units; every tenth of them was restarted
    assert (t.events[2].kind, t.events[2].label) == ("dispatched", "units 1-100 dispatched")
    restarted = [e.label for e in t.events if e.kind == "restarted"]
    assert restarted and all(
        re.fullmatch(r"(9|10|11) units in \d+-\d+ restarted after a lost worker", x) for x in restarted
    )
    page = html(alpha.get(f"/console/jobs/{batch['id']}"))
    assert len(events_of(page)) == job_events.MAX_EVENTS
    assert f"… {t.left_out:,} more events" in page
    assert "grouped per 20 min" in page


def test_the_chart_moves_with_heartbeats_of_running_units(app, runtime, keys, alpha):  # noqa: F811
    """No unit has finished yet: the chart still shows what the running units' heartbeats
    reported (requests and output tokens so far, over [started, latest heartbeat])."""
    batch = api_batch(app, keys["a"])
    t = float(now())
    with runtime.db.write() as s:
        b = s.get(Batch, batch["id"])
        b.status, b.model, b.in_progress_at, b.request_total = "in_progress", "demo", int(t) - 60, 20
        s.execute(insert(WorkUnit), [
            unit(b.id, 0, started_at=t - 50, heartbeat_at=t - 10, status=UnitStatus.RUNNING, completed=4,
                 completion_tokens=400, worker="w:1-0a1b2c3d:x"),
            unit(b.id, 1, status=UnitStatus.PENDING),
        ])  # fmt: skip
    page = html(alpha.get(f"/console/jobs/{batch['id']}"))
    assert page.count('<rect class="bar"') > 1 and "No work unit has started yet" not in page
    peak = float(re.search(r"peak ([\d.]+) output tok/s", page).group(1))  # type: ignore[union-attr]
    assert abs(peak - 10.0) < 0.5  # 400 tokens over the 40 s between start and latest heartbeat
    assert 'id="count-completed">4<' in page  # the running unit's completed requests so far
    with runtime.db.write() as s:  # the next heartbeat: more tokens, later
        s.get(WorkUnit, s.query(WorkUnit.id).filter_by(batch_id=batch["id"], seq=0).scalar()).completion_tokens = 900  # type: ignore[union-attr]  # fmt: skip
    later = html(alpha.get(f"/console/jobs/{batch['id']}"))
    assert float(re.search(r"mean ([\d.]+) tok/s", later).group(1)) > float(re.search(r"mean ([\d.]+) tok/s", page).group(1))  # type: ignore[union-attr]  # fmt: skip


def test_an_expired_jobs_split_and_the_list_reads_stopped_counts_in_one_query(app, runtime, keys, alpha):  # noqa: F811
    """The window ran out: the bar says expired (what the end kept from running), the timeline
    says when the window ended; the jobs list reads every stopped job's split in one statement."""
    expired = api_batch(app, keys["a"])
    cancelled = api_batch(app, keys["a"])
    with runtime.db.write() as s:
        b = s.get(Batch, expired["id"])
        b.created_at, b.in_progress_at, b.finalizing_at, b.expired_at = T0, T0 + 5, T0 + 3600, T0 + 3610
        b.status, b.final_status, b.model, b.request_total = "expired", "expired", "demo", 30
        b.request_completed, b.request_failed, b.expires_at = 12, 18, T0 + 3600
        c = s.get(Batch, cancelled["id"])
        c.status, c.cancelling_at, c.cancelled_at, c.request_total, c.request_failed = (
            "cancelled",
            T0,
            T0 + 1,
            10,
            10,
        )
        s.execute(insert(WorkUnit), [
            unit(b.id, 0, started_at=T0 + 10, finished_at=T0 + 900, status=UnitStatus.DONE, completed=10),
            unit(b.id, 1, started_at=T0 + 3000, finished_at=T0 + 3601, status=UnitStatus.DONE, completed=2, failed=8),
            unit(b.id, 2, finished_at=T0 + 3600, status=UnitStatus.SKIPPED),
            unit(c.id, 0, finished_at=T0, status=UnitStatus.SKIPPED),
        ])  # fmt: skip
    page = html(alpha.get(f"/console/jobs/{expired['id']}"))
    assert 'id="count-completed">12<' in page and 'id="count-stopped">18<' in page
    assert "<dt>Expired</dt>" in page and 'id="count-failed">0<' in page
    kinds = [k for k, _ in events_of(page)]
    assert kinds.index("expired") < kinds.index("finalizing") < kinds.index("final")
    assert "window ended" in dict(events_of(page))["expired"]
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    with runtime.db.read() as s:
        engine = s.get_bind()
    event.listen(engine, "after_cursor_execute", record)
    try:
        listing = html(alpha.get("/console/jobs"))
    finally:
        event.remove(engine, "after_cursor_execute", record)
    assert sum("n_requests" in x for x in statements) == 1  # both stopped jobs' splits, one query
    row = listing[listing.index(f'id="job-{expired["id"]}"') :].split("</tr>")[0]
    assert 'data-completed="12" data-stopped="18" data-failed="0"' in row and "18</span> expired" in row
    row = listing[listing.index(f'id="job-{cancelled["id"]}"') :].split("</tr>")[0]
    assert 'data-completed="0" data-stopped="10" data-failed="0"' in row and "10</span> cancelled" in row
