"""Issue 21 section 4: isolation inside the control plane, on a live stack (PostgreSQL, Redis, the
control worker as `freight worker --control` runs it, a real vLLM engine, beat).

Tenant alpha submits six large batches at once (40,000 lines each), enough to fill the validation
pool for about twenty seconds; tenant beta's small batch, submitted behind them, still starts (is validated) and
finishes within the bounds below, because alpha holds at most FREIGHT_TENANT_VALIDATIONS (2) of the
three validation processes; and the dispatcher tick, on its own queue and pool, keeps its period
while the flood holds the pool (its runs are counted in the control worker's log).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import openai
import pytest
from sqlalchemy import func, select

from storage.db import Database
from storage.models import Batch, Tenant
from storage.status import BatchStatus
from tests.e2e.batch_client import chat_line, upload
from tests.e2e.conftest import CHAT, LiveStack, keep_logs, start_live

pytestmark = pytest.mark.stack

FLOOD_BATCHES = 6
FLOOD_LINES = 40_000  # each validates for about 7 s on this 2-core machine: ~20 s of full pool
SMALL_LINES = 8
# The bounds, about 2-3x what was measured on the 2-core hosts: alone, beta's batch was validated
# 0.34-1.07 s and completed 3.4-4.7 s after its create; with eight other test runs loading the
# machine (load average 12), 2.3 s and 5.8 s, with 15 ticks in 15.1 s and no gap past 1.0 s.
START_BOUND_S = 5.0  # beta's batch validated (in_progress or later) this soon after it was created
DONE_BOUND_S = 15.0  # and completed this soon
TICK_SECONDS = 1.0  # start_live's FREIGHT_TICK_SECONDS
MAX_TICK_GAP_S = 2.5  # a tick late by most of a period, never a period missed and the next late too
MIN_TICK_SHARE = 0.9  # of the periods in the window, each with its tick finished
TICK_WINDOW_S = 15.0  # the tick's period is checked over at least this long with the pool full


@pytest.fixture(scope="module")
def iso(tmp_path_factory: pytest.TempPathFactory, demo_model: Path, postgres_service) -> Iterator[LiveStack]:
    overrides = {
        "FREIGHT_DATABASE_URL": postgres_service.create_database(f"iso_{uuid.uuid4().hex[:10]}"),
        "FREIGHT_MAX_FILE_BYTES": str(16 * 1024 * 1024),
        "FREIGHT_UNIT_SIZE": "64",
        # No early slices: what is measured is the control plane (the validation pool, the tick),
        # as when the bounds above were measured. With slices on (the default since 02652e5) the
        # flood's first rows reach the engine at once, and beta's unit waits in the engine's feed
        # for alpha's turn of up to FREIGHT_PACK_REQUESTS requests (workers/pack_feed.py's
        # quantum): in a full make test run on 2026-11-30 beta's batch, validated after 0.59 s,
        # was still in_progress at 15 s behind a pack of 968 requests that took the loaded engine
        # 12.9 s, and the tick's longest gap was 2.6 s with the engine busy beside it. (A turn now
        # ends after FREIGHT_FEED_TURN_SECONDS too, tests/scheduler/test_feed_order.py; the engine
        # busy beside the tick on these two cores is still not what this test measures.)
        "FREIGHT_VALIDATION_HEAD_ROWS": "0",
    }
    live_stack, stack = start_live(tmp_path_factory.mktemp("iso"), demo_model, overrides, ("alpha", "beta"))
    try:
        yield live_stack
    finally:
        # the flood's validations still run: a warm shutdown would wait the whole stop deadline
        keep_logs(stack, "isolation", stop_timeout=2.0)


def tick_times(log: Path, offset: int) -> list[float]:
    """Epoch times of the dispatcher ticks the control worker finished since ``offset``."""
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    times = []
    for line in lines:
        if "Task freight.tick[" in line and " succeeded in " in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")  # local time, as logged
            times.append(stamp.timestamp())
    return times


def running_validations(db: Database, tenant: str) -> int:
    with db.read() as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(Batch)
                .join(Tenant, Tenant.id == Batch.tenant_id)
                .where(
                    Tenant.name == tenant,
                    Batch.status == BatchStatus.VALIDATING,
                    Batch.validation_heartbeat_at.is_not(None),
                )
            )
            or 0
        )


def test_a_flood_of_uploads_holds_up_neither_another_tenant_nor_the_tick(iso: LiveStack):
    alpha, beta = iso.client("alpha"), iso.client("beta")
    # the uploads first: what is measured is the control plane, not the API taking the files
    flood_files = [
        upload(alpha, [chat_line(f"a{n}-{i}", f"flood {n} question {i}", max_tokens=1) for i in range(FLOOD_LINES)])
        for n in range(FLOOD_BATCHES)
    ]  # fmt: skip
    small_file = upload(
        beta, [chat_line(f"b{i}", f"small question {i}", max_tokens=4) for i in range(SMALL_LINES)]
    )
    log = iso.stack.log("control")
    offset = log.stat().st_size
    window_start = time.time()
    flood = [
        alpha.batches.create(input_file_id=f, endpoint=CHAT, completion_window="24h").id for f in flood_files
    ]
    db = Database(iso.stack.settings.database_url)
    try:
        deadline = time.monotonic() + 30
        while running_validations(db, "alpha") < 2:  # alpha's validations hold the pool
            assert time.monotonic() < deadline, "alpha's validations did not start"
            time.sleep(0.2)
        created = time.monotonic()
        small = beta.batches.create(input_file_id=small_file, endpoint=CHAT, completion_window="24h")
        started = done = None
        most_running = 0
        while time.monotonic() < created + DONE_BOUND_S:
            most_running = max(most_running, running_validations(db, "alpha"))
            status = beta.batches.retrieve(small.id).status
            if started is None and status != "validating":
                started = time.monotonic() - created
            if status in ("completed", "failed", "expired", "cancelled"):
                done = time.monotonic() - created
                break
            time.sleep(0.3)
        # the tick is watched from the flood's creation to beta's batch done, and on to at least
        # TICK_WINDOW_S: alpha's validations held the pool that whole time (asserted below: at
        # least two of them still validating at its end)
        while time.time() < window_start + TICK_WINDOW_S:
            most_running = max(most_running, running_validations(db, "alpha"))
            time.sleep(0.5)
        window_end = time.time()
        flood_states = [alpha.batches.retrieve(batch_id).status for batch_id in flood]
    finally:
        db.dispose()
    final = beta.batches.retrieve(small.id)
    ticks = [t for t in tick_times(log, offset) if window_start <= t <= window_end + 1]
    gaps = [b - a for a, b in zip([window_start, *ticks], [*ticks, window_end], strict=True)]
    window = window_end - window_start
    print(
        f"beta's batch: validated after {started}s, {final.status} after {done}s; alpha's batches then: "
        f"{flood_states}; most of alpha's validations at once: {most_running}; {len(ticks)} ticks in "
        f"{window:.1f}s, longest gap {max(gaps):.1f}s"
    )
    for batch_id in flood:  # the flood's inference is not this test's business
        with contextlib.suppress(openai.ConflictError):  # final already
            alpha.batches.cancel(batch_id)

    assert final.status == "completed" and final.request_counts.completed == SMALL_LINES, final
    assert started is not None and started <= START_BOUND_S, started
    assert done is not None and done <= DONE_BOUND_S, done
    # the flood still held the validation pool when beta's batch was done: it did not wait for it
    assert flood_states.count("validating") >= 2, flood_states
    assert most_running == 2  # never more than FREIGHT_TENANT_VALIDATIONS of alpha's at once
    # the tick kept its period through the flood
    assert len(ticks) >= MIN_TICK_SHARE * window / TICK_SECONDS, (len(ticks), window)
    assert max(gaps) <= MAX_TICK_GAP_S, gaps
