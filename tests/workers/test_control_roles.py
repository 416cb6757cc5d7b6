"""The control plane's roles, against a real database (SQLite and PostgreSQL) and a real broker.

A tenant holds at most FREIGHT_TENANT_VALIDATIONS validations at once: another of its batches is
sent again with a countdown (acknowledged, not a retry, the batch untouched) while other tenants'
batches validate. The control worker itself (``workers.control``), one process per role, is run as
``freight worker --control`` runs it: a validation past its time limit is stopped and its batch
failed naming the limit; a message left in the queue of releases before the roles still runs;
SIGTERM stops every role warm; a role that dies is started again, and one that keeps dying takes
the supervisor down with status 1.

The cap's tests run the validation and estimate tasks in this process through Celery's own task
objects (``apply``): the cap is a decision inside the task (a lease count under the tenant's row
lock, then a send with a countdown), and the send is read back from the real broker; a worker
would add a process but no decision. The roles' own tests below run the real supervisor."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import update

from api.services import estimates as estimate_service
from api.services.tenants import create_tenant
from scheduler.leases import TENANT_TURN_WAIT_SECONDS
from storage.broker import LEGACY_CONTROL_QUEUE, TICK_QUEUE, VALIDATE_QUEUE
from storage.models import Batch, Estimate
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import BatchStatus, EstimateStatus
from tests.conftest import REPO, now
from tests.factories import chat_line, upload, upload_and_create
from workers import estimates, validation
from workers.celery_app import make_celery
from workers.control import RestartBudget

LINES = [chat_line("a"), chat_line("b")]
LIMIT_S = 3.0  # the control worker's validation time limit in its own tests
CHAT = "/v1/chat/completions"


def batch_row(rt: Runtime, batch_id: str) -> Batch:
    with rt.db.read() as s:
        row = s.get(Batch, batch_id)
        assert row is not None
        return row


def validation_messages(rt: Runtime) -> list[dict]:
    with rt.queue.celery.connection_for_write() as conn:
        raw = conn.default_channel.client.lrange(VALIDATE_QUEUE, 0, -1)
    return [json.loads(m)["headers"] for m in raw]


def test_a_tenant_at_its_validation_cap_waits_while_others_validate(settings, redis_service):
    # a broker database of its own: the messages counted below are this test's
    settings = replace(settings, broker_url=redis_service.url.rsplit("/", 1)[0] + "/7", tenant_validations=2)
    rt = Runtime(settings)
    try:
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
        busy = create_tenant(rt.db, "busy", now())[0].id
        other = create_tenant(rt.db, "other", now())[0].id
        running = [upload_and_create(rt, busy, LINES, name=f"r{i}.jsonl").id for i in range(2)]
        waiting = upload_and_create(rt, busy, LINES, name="w.jsonl").id
        theirs = upload_and_create(rt, other, LINES, name="o.jsonl").id
        t = time.time()
        with rt.db.write() as s:  # two validations of the tenant hold live leases
            s.execute(update(Batch).where(Batch.id.in_(running)).values(validation_heartbeat_at=t))

        app = make_celery(settings)
        app.runtime = rt
        result = app.tasks["freight.validate_batch"].apply(args=[waiting])
        assert result.successful()
        row = batch_row(rt, waiting)
        assert row.status == BatchStatus.VALIDATING and row.errors is None  # untouched, not failed
        assert row.validation_heartbeat_at is None  # no lease taken
        assert row.validation_due_at is not None and row.validation_due_at >= t + TENANT_TURN_WAIT_SECONDS - 1
        # sent again, with a countdown, as a new message (beside those the batches' creation sent)
        [sent] = [m for m in validation_messages(rt) if m["eta"] is not None]
        assert sent["task"] == "freight.validate_batch" and sent["argsrepr"] == repr([waiting])
        assert sent["eta"] is not None and sent["retries"] == 0  # not a retry

        # another tenant's batch validates meanwhile
        app.tasks["freight.validate_batch"].apply(args=[theirs])
        assert batch_row(rt, theirs).status == BatchStatus.IN_PROGRESS

        # an expired lease is no running validation: the tenant's turn comes
        with rt.db.write() as s:
            stale = t - settings.lease_seconds - 1
            s.execute(update(Batch).where(Batch.id == running[0]).values(validation_heartbeat_at=stale))
        assert validation.validate_batch(rt, waiting) is None
        assert batch_row(rt, waiting).status == BatchStatus.IN_PROGRESS
    finally:
        rt.db.dispose()


def test_a_tenants_estimates_and_validations_share_one_cap(settings, redis_service):
    """Dry runs read files on the validation pool too: a tenant's validations and estimates
    holding a live lease count together against FREIGHT_TENANT_VALIDATIONS (before, each kind had
    a cap of 2 of its own, so one tenant held 4 of the pool's 3 processes)."""
    settings = replace(settings, broker_url=redis_service.url.rsplit("/", 1)[0] + "/9", tenant_validations=2)
    rt = Runtime(settings)
    try:
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
        busy = create_tenant(rt.db, "busy", now())[0].id
        other = create_tenant(rt.db, "other", now())[0].id

        def dry_run(tenant: str) -> str:
            file_id = upload(rt, tenant, LINES, name="d.jsonl").id
            payload = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            return estimate_service.create(rt, tenant, payload).id

        running_batch = upload_and_create(rt, busy, LINES, name="r.jsonl").id
        running_estimate = dry_run(busy)
        t = time.time()
        with rt.db.write() as s:  # one validation and one estimate of the tenant hold live leases
            s.execute(update(Batch).where(Batch.id == running_batch).values(validation_heartbeat_at=t))
            s.execute(update(Estimate).where(Estimate.id == running_estimate).values(lease_at=t))
        app = make_celery(settings)
        app.runtime = rt

        # a third of either kind waits its turn: sent again with a countdown, untouched
        waiting_batch = upload_and_create(rt, busy, LINES, name="w.jsonl").id
        assert app.tasks["freight.validate_batch"].apply(args=[waiting_batch]).successful()
        assert batch_row(rt, waiting_batch).status == BatchStatus.VALIDATING
        assert batch_row(rt, waiting_batch).validation_heartbeat_at is None
        waiting_estimate = dry_run(busy)
        assert app.tasks["freight.estimate"].apply(args=[waiting_estimate]).successful()
        row = estimate_row(rt, waiting_estimate)
        assert row.status == EstimateStatus.VALIDATING and row.lease_at is None and row.errors is None
        later = {m["task"]: m for m in validation_messages(rt) if m["eta"] is not None}
        assert later["freight.estimate"]["argsrepr"] == repr([waiting_estimate])
        assert later["freight.estimate"]["retries"] == 0  # not a retry
        assert later["freight.validate_batch"]["argsrepr"] == repr([waiting_batch])

        # another tenant's estimate is made meanwhile, and gives its lease back
        theirs = dry_run(other)
        assert app.tasks["freight.estimate"].apply(args=[theirs]).successful()
        assert estimate_row(rt, theirs).status == EstimateStatus.COMPLETED
        assert estimate_row(rt, theirs).lease_at is None

        # the validation's lease runs out: the waiting estimate takes the turn, then, its lease
        # given back, the waiting batch
        with rt.db.write() as s:
            stale = t - settings.lease_seconds - 1
            s.execute(update(Batch).where(Batch.id == running_batch).values(validation_heartbeat_at=stale))
        assert estimates.run(rt, waiting_estimate) is None
        assert estimate_row(rt, waiting_estimate).status == EstimateStatus.COMPLETED
        assert validation.validate_batch(rt, waiting_batch) is None
        assert batch_row(rt, waiting_batch).status == BatchStatus.IN_PROGRESS
    finally:
        rt.db.dispose()


def estimate_row(rt: Runtime, estimate_id: str) -> Estimate:
    with rt.db.read() as s:
        row = s.get(Estimate, estimate_id)
        assert row is not None
        return row


# -- the control worker, as `freight worker --control` runs it -----------------------------------


def test_a_roles_restarts_back_off_and_run_out_within_their_window() -> None:
    budget = RestartBudget(limit=3, window=100)
    assert [budget.next_start("tick", t) - t for t in (0, 1, 2)] == [1, 2, 4]  # type: ignore[operator]
    assert budget.next_start("tick", 3) is None  # a fourth within 100 s: given up
    assert budget.next_start("validate", 3) == 4  # each role has its own
    assert budget.next_start("tick", 101.5) == 103.5  # the restarts at 0 and 1 have left the window
    many = RestartBudget(limit=10, window=1000)
    assert [many.next_start("tick", 0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "FREIGHT_DATA_DIR": str(settings.data_dir),
        "FREIGHT_DATABASE_URL": settings.database_url,
        "FREIGHT_BROKER_URL": settings.broker_url,
        "FREIGHT_MODELS": ",".join(f"{k}={v}" for k, v in settings.models.items()),
        "FREIGHT_COMPLETION_WINDOWS": ",".join(settings.completion_windows),
        **extra,
    }


def wait_until(check, what: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout}s\n{log.read_text(errors='replace')[-4000:]}")


def wait_final(rt: Runtime, batch_id: str, timeout: float = 60) -> None:
    """Until the batch has left ``validating``."""
    deadline = time.monotonic() + timeout
    while batch_row(rt, batch_id).status == BatchStatus.VALIDATING and time.monotonic() < deadline:
        time.sleep(0.1)


def role_or_none(pid: int) -> str | None:
    """``role_of``, or None for a process that has not exec'd its role yet or has gone."""
    try:
        return role_of(pid)
    except (AssertionError, FileNotFoundError, ProcessLookupError):
        return None


def role_of(pid: int) -> str:
    """The role a process of the control worker runs (Celery retitles it; the argv stays in it)."""
    match = re.search(
        r"--role (\w+)", Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    )
    assert match, pid
    return match.group(1)


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def bytes_written(pid: int) -> int:
    """What the process has written to any file, pipe or socket (``wchar`` of /proc/PID/io)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar in /proc/{pid}/io")


def signal_pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits to be delivered to process ``pid`` (a stopped one: on its way)."""
    bit = 1 << (signum - 1)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & bit:
            return True
    return False


def quiet_bytes_written(pid: int, quiet: float = 0.3, timeout: float = 30) -> int:
    """``bytes_written`` once it has not changed for ``quiet`` seconds (the process is idle)."""
    deadline = time.monotonic() + timeout
    last, since = bytes_written(pid), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"process {pid} kept writing"
        time.sleep(0.01)
        now_written = bytes_written(pid)
        if now_written != last:
            last, since = now_written, time.monotonic()
    return last


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_the_control_worker_runs_each_role_in_its_own_pool(settings, redis_service, tmp_path):
    settings = replace(
        settings, broker_url=redis_service.url.rsplit("/", 1)[0] + "/8", max_file_bytes=16 << 20
    )
    rt = Runtime(settings)
    log = tmp_path / "control.log"
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.flushdb()
    tenant = create_tenant(rt.db, "a", now())[0].id
    # a message left in the queue of releases before the roles (an upgrade): it still runs
    small = upload_and_create(rt, tenant, LINES, name="small.jsonl").id
    with rt.queue.celery.connection_for_write() as conn:
        conn.default_channel.client.delete(VALIDATE_QUEUE)  # the message its creation sent
    rt.queue.celery.send_task("freight.validate_batch", args=[small], queue=LEGACY_CONTROL_QUEUE)
    env = worker_env(
        settings,
        # 3 s: every validation of a few lines here ends well inside it, however loaded the host
        # (a cold pool's first took 0.55 s of a 0.5 s limit once, and one of a 0.8 s limit failed
        # in CI); the two past it are made so by stopping their pool process
        FREIGHT_VALIDATION_TIME_LIMIT_SECONDS=f"{LIMIT_S:g}",
        FREIGHT_VALIDATION_CONCURRENCY="1",
        FREIGHT_CONTROL_ROLE_RESTARTS="1",
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.bootstrap", "worker", "--control"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: " ready." in log.read_text(errors="replace"), "ready", 120, proc, log)
        text = log.read_text(errors="replace")
        assert text.count(" ready.") == 1  # the supervisor's, once every role is: the roles' are left out
        roles = children_of(proc.pid)
        assert len(roles) == 4
        assert sorted(role_of(p) for p in roles) == ["finalize", "tick", "validate", "webhook"]
        # each role's own prefork pool; the webhook role's attempts wait on the network in threads
        assert all(bool(children_of(p)) == (role_of(p) != "webhook") for p in roles)

        # a validation past FREIGHT_VALIDATION_TIME_LIMIT_SECONDS: this file, under the
        # 50,000-request default, takes seconds; its pool process is stopped once the validation
        # holds its lease (inside the task) and goes on once the soft limit's signal waits for it,
        # so the validation is past its limit on any host, and raises there
        [pool] = children_of(next(p for p in roles if role_of(p) == "validate"))
        lines = [chat_line(f"r{i}", f"question {i}") for i in range(49_000)]
        big = upload_and_create(rt, tenant, lines, name="big.jsonl").id
        deadline = time.monotonic() + 60
        while batch_row(rt, big).validation_heartbeat_at is None:
            assert time.monotonic() < deadline, "the validation of big.jsonl did not start"
            time.sleep(0.005)
        os.kill(pool, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while not signal_pending(pool, signal.SIGUSR1):  # Celery's soft limit, sent by the role
                assert time.monotonic() < deadline, "no soft time limit reached the stopped validation"
                time.sleep(0.01)
        finally:
            os.kill(pool, signal.SIGCONT)
        wait_final(rt, big)
        row = batch_row(rt, big)
        assert row.status == BatchStatus.FAILED, row.status  # stopped, not left validating
        [error] = row.errors["data"]
        assert error["message"] == (
            "validation failed: internal error in step validate_batch: TaskTimeLimit: ran past its time limit"
            f" of {LIMIT_S:g}s (FREIGHT_VALIDATION_TIME_LIMIT_SECONDS)"
        )

        # one stuck past the soft limit (its process stopped) is killed at the hard limit (10 s
        # later) and its batch failed all the same
        idle = quiet_bytes_written(pool)  # after its last writes for the task before (its result)
        stuck = upload_and_create(rt, tenant, lines, name="stuck.jsonl").id
        # stopped the moment it takes the task: its first write is the acceptance it sends the pool
        # (the limits count from it), so the stop lands well inside the soft limit however
        # slow the machine (the batch's heartbeat, a database round trip later, did not always)
        deadline = time.monotonic() + 30
        while bytes_written(pool) == idle:
            assert time.monotonic() < deadline, "the validation of stuck.jsonl did not start"
            time.sleep(0.001)
        os.kill(pool, signal.SIGSTOP)
        wait_final(rt, stuck, 40)
        [error] = batch_row(rt, stuck).errors["data"]
        assert error["message"].endswith("(FREIGHT_VALIDATION_TIME_LIMIT_SECONDS) and was killed"), error
        assert f"Hard time limit ({LIMIT_S + 10}s) exceeded" in log.read_text(errors="replace")

        row = batch_row(rt, small)
        assert row.status == BatchStatus.IN_PROGRESS, row.errors  # from the old queue
        # and the pool lives on past the stopped and the killed task
        after = upload_and_create(rt, tenant, LINES, name="after.jsonl").id
        wait_final(rt, after, 30)
        row = batch_row(rt, after)
        assert row.status == BatchStatus.IN_PROGRESS, row.errors

        # a role that dies is started again, the others left running; it serves its queue
        tick_role = next(p for p in roles if role_of(p) == "tick")
        others = sorted(p for p in roles if p != tick_role)
        os.kill(tick_role, signal.SIGKILL)

        def new_tick_role() -> list[int]:
            # a child caught between fork and exec has no --role yet: not the role (yet)
            return [p for p in children_of(proc.pid) if p not in roles and role_or_none(p) == "tick"]

        wait_until(lambda: bool(new_tick_role()), "the tick role started again", 60, proc, log)
        [tick_role] = new_tick_role()
        ready_twice = lambda: log.read_text(errors="replace").count("role tick ready") == 2  # noqa: E731
        wait_until(ready_twice, "the tick role ready again", 120, proc, log)
        assert sorted(p for p in children_of(proc.pid) if p != tick_role) == others
        tick = rt.queue.celery.send_task("freight.tick", queue=TICK_QUEUE)
        wait_until(
            lambda: f"freight.tick[{tick.id}] succeeded" in log.read_text(errors="replace"),
            "a tick run by the new tick role", 60, proc, log,
        )  # fmt: skip
        assert "role tick exited on its own (status -9); starting it again in 1 s" in log.read_text(
            errors="replace"
        )

        # past FREIGHT_CONTROL_ROLE_RESTARTS (1 here) the supervisor gives up: it stops the other
        # roles and exits 1, for the process manager
        roles = children_of(proc.pid)
        os.kill(tick_role, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        for pid in roles:
            assert (
                not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            )
        assert "role tick exited on its own (status -9) after 1 restarts in 600 s; stopping the others" in (
            log.read_text(errors="replace")
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rt.db.dispose()


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_sigterm_stops_every_role_warm(settings, tmp_path):
    log = tmp_path / "control.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.bootstrap", "worker", "--control"],
            cwd=REPO, env=worker_env(settings), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: " ready." in log.read_text(errors="replace"), "ready", 120, proc, log)
        roles = children_of(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)  # as make stop signals it: the whole group
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not [p for p in roles if Path(f"/proc/{p}").exists()]
        assert log.read_text(errors="replace").count("warm shutdown") >= 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
