"""Issue 8, faults II: Redis, the API and PostgreSQL restarted mid-batch, and the whole stack
stopped and started again mid-batch. Each batch must still complete with every ``custom_id``
exactly once across its output and error files, counts and usage adding up; a client polling with
the official ``openai`` client through the fault sees connection errors at most (API restart) and
503s only while the database is down.

One PostgreSQL-backed stack serves every scenario. Small units and packs keep some units queued in
Redis and others running when a fault hits, so each fault meets work in every state.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import pytest
from sqlalchemy import func, select

from infra import daemons as services
from infra.processes import up
from storage.db import Database
from storage.models import EngineSample, UnitStatus, WorkUnit
from tests.e2e.batch_client import CHAT, chat_line, read_jsonl, upload
from tests.e2e.conftest import LiveStack, keep_logs, start_live, wait_final

pytestmark = [pytest.mark.stack, pytest.mark.reliability]

UNIT = 8
TOTAL = 480  # with 8 sequences at once, long enough to be mid-run when the fault hits
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def faults(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path, postgres_service
) -> Iterator[LiveStack]:
    overrides = {
        "FREIGHT_DATABASE_URL": postgres_service.create_database(f"faults_{uuid.uuid4().hex[:10]}"),
        "FREIGHT_UNIT_SIZE": str(UNIT),
        "FREIGHT_PACK_REQUESTS": "32",
        "FREIGHT_QUEUE_DEPTH": "2",
        "FREIGHT_HEARTBEAT_SECONDS": "1",
        "FREIGHT_LEASE_SECONDS": "10",
        "FREIGHT_ENGINE_MAX_NUM_SEQS": "8",
        "FREIGHT_DRAIN_SECONDS": "5",
    }
    live_stack, _ = start_live(tmp_path_factory.mktemp("faults"), demo_model, overrides, ("alpha",))
    try:
        yield live_stack
    finally:
        keep_logs(live_stack.stack, "faults")  # the stack object may have been replaced by a restart


class Poller(threading.Thread):
    """Polls a batch through a fault, sorting every answer: ok, connection error, 5xx (with its
    time); keeps the first 5xx response for its headers and body."""

    def __init__(self, client: openai.OpenAI, batch_id: str) -> None:
        super().__init__(daemon=True)
        self.client, self.batch_id = client, batch_id
        self.ok = self.connection_errors = 0
        self.server_errors: list[tuple[float, int]] = []
        self.first_5xx: httpx.Response | None = None
        self.other_errors: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.2):
            try:
                self.client.batches.retrieve(self.batch_id)
                self.ok += 1
            except openai.APIConnectionError:  # refused, reset or timed out
                self.connection_errors += 1
            except openai.APIStatusError as exc:
                if exc.status_code >= 500:
                    self.server_errors.append((time.time(), exc.status_code))
                    self.first_5xx = self.first_5xx or exc.response
                else:
                    self.other_errors.append(f"{exc.status_code}: {exc.message}")

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)


def submit(live: LiveStack, tag: str) -> tuple[openai.OpenAI, str, list[str]]:
    client = live.client("alpha")
    lines = [
        chat_line(
            f"{tag}-{i}", f"{tag} item {i}: say something", max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS
        )
        for i in range(TOTAL)
    ]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    return client, batch.id, [x["custom_id"] for x in lines]


def wait_mid_run(client: openai.OpenAI, batch_id: str, at_least: int = UNIT, timeout: float = 300) -> int:
    """Block until ``at_least`` but not all requests are done; returns how many are."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        assert batch.status in ("validating", "in_progress"), batch
        done = batch.request_counts.completed + batch.request_counts.failed
        if done >= at_least:
            assert done < TOTAL - 4 * UNIT, (
                f"batch nearly done ({done}/{TOTAL}) before the fault: make it longer"
            )
            return done
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} made no progress in {timeout}s")


def check_results(client: openai.OpenAI, batch_id: str, expected: list[str]) -> dict[str, int]:
    """Completed; each custom_id once across both files; counts and usage add up. Returns the
    lost/duplicated figures (asserted zero by the caller after recording)."""
    batch = wait_final(client, batch_id, timeout=600)
    assert batch.status == "completed", batch
    output, errors = read_jsonl(client, batch.output_file_id), read_jsonl(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors]
    figures = {"lost": len(set(expected) - set(ids)), "duplicated": len(ids) - len(set(ids))}
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (TOTAL, len(output), len(errors))
    usage = [line["response"]["body"]["usage"] for line in output]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usage)
    return figures


def units(live: LiveStack, batch_id: str) -> list[WorkUnit]:
    database = Database(live.stack.settings.database_url)
    try:
        with database.read() as s:
            return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id)).all())
    finally:
        database.dispose()


def first_finish_after(live: LiveStack, batch_id: str, since: float) -> float | None:
    """Seconds from ``since`` until the first unit claimed after it was recorded: work flowing
    through the broker again (None if no unit was claimed after ``since``)."""
    done = [u.finished_at for u in units(live, batch_id) if u.started_at and u.started_at >= since]
    return round(min(done) - since, 2) if done else None


def test_redis_restarted_mid_batch(faults: LiveStack, reliability) -> None:
    """Redis keeps nothing across a restart (``--save ""``): queued pack messages vanish and the
    system recovers them from the database; workers, beat and the control worker reconnect."""
    client, batch_id, expected = submit(faults, "redis")
    wait_mid_run(client, batch_id)
    poller = Poller(client, batch_id)
    poller.start()
    run_dir = faults.stack.run_dir
    port = urlparse(faults.stack.settings.broker_url).port
    assert port is not None
    control_log = faults.stack.log("control")
    offset = control_log.stat().st_size
    stopped = time.time()
    assert services.stop_pidfile(run_dir / "redis.pid")
    time.sleep(2)  # the outage
    services.start_redis(run_dir, port)
    back = time.time()
    figures = check_results(client, batch_id, expected)
    poller.stop()
    recovery_s = first_finish_after(faults, batch_id, back)
    reliability.record(
        "redis_restart",
        **figures,
        server_errors=len(poller.server_errors),
        downtime_s=round(back - stopped, 2),
        recovery_s=recovery_s,
        requests=TOTAL,
    )
    assert figures == {"lost": 0, "duplicated": 0}
    assert not poller.server_errors and not poller.other_errors and poller.ok
    assert recovery_s is not None, "no unit went through the restarted broker"
    with open(control_log, "rb") as f:  # found out from the broker, not after a lease
        f.seek(offset)
        assert b"the broker lost its messages" in f.read()


def test_api_restarted_mid_batch(faults: LiveStack, reliability) -> None:
    """SIGTERM to gunicorn and a fresh one with the same argv: clients see refused connections
    while it is down, never a 5xx; the batch does not notice."""
    client, batch_id, expected = submit(faults, "api")
    wait_mid_run(client, batch_id)
    poller = Poller(client, batch_id)
    poller.start()
    stopped = time.time()
    faults.stack.restart("api")
    back = time.time()
    before = poller.ok
    deadline = time.monotonic() + 30
    while poller.ok == before and time.monotonic() < deadline:  # the poller sees the new API
        time.sleep(0.1)
    figures = check_results(client, batch_id, expected)
    poller.stop()
    reliability.record(
        "api_restart",
        **figures,
        server_errors=len(poller.server_errors),
        downtime_s=round(back - stopped, 2),
        connection_errors=poller.connection_errors,
        requests=TOTAL,
    )
    assert figures == {"lost": 0, "duplicated": 0}
    assert not poller.server_errors and not poller.other_errors
    assert poller.connection_errors > 0, "the poller never saw the API down: the fault did not happen"
    assert poller.ok > before


def test_postgres_restarted_mid_batch(
    faults: LiveStack, reliability, postgres_service, services_dir: Path
) -> None:
    """PostgreSQL fast-stopped for a few seconds (every open connection cut) and started again:
    workers, the control worker and the API reconnect; during the outage the API answers 503 with
    ``Retry-After``, never 500; after it, no 5xx at all."""
    client, batch_id, expected = submit(faults, "pg")
    wait_mid_run(client, batch_id)
    poller = Poller(client, batch_id)
    poller.start()
    stopped = time.time()
    services.restart_postgres(postgres_service, pause=3)
    back = time.time()
    probe = _retrieve_raw(faults, batch_id)
    figures = check_results(client, batch_id, expected)
    poller.stop()
    during = [code for t, code in poller.server_errors if t <= back + 1]
    after = [code for t, code in poller.server_errors if t > back + 1]
    reliability.record(
        "postgres_restart",
        **figures,
        server_errors=len(poller.server_errors),
        server_errors_after_restart=len(after),
        status_500=sum(code == 500 for code in during + after),
        connection_errors=poller.connection_errors,
        downtime_s=round(back - stopped, 2),
        recovery_s=first_finish_after(faults, batch_id, back),
        requests=TOTAL,
    )
    assert figures == {"lost": 0, "duplicated": 0}
    assert probe == 200
    assert during, "the poller saw no error while the database was down: the fault did not happen"
    assert set(during) == {503}, during
    assert not after and not poller.other_errors
    # an outage answers like OpenAI's own: 503, server_error, and when to come back
    assert poller.first_5xx is not None and int(poller.first_5xx.headers["Retry-After"]) > 0
    error = poller.first_5xx.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "service_unavailable")


def _retrieve_raw(live: LiveStack, batch_id: str) -> int:
    """Status of one GET right after the restart: pooled connections that died are replaced."""
    client = live.client("alpha")
    return client.batches.with_raw_response.retrieve(batch_id).status_code


def test_full_stack_restart_resumes(faults: LiveStack, reliability) -> None:
    """Every Freight process and Redis stopped mid-batch, then ``infra.processes.up`` on the same run
    folder and database: the batch goes on from the units it had recorded, not from zero."""
    client, batch_id, expected = submit(faults, "full")
    wait_mid_run(client, batch_id, at_least=TOTAL // 4)
    old = faults.stack
    stopped = time.time()
    old.stop()
    before = units(faults, batch_id)
    completed_before = sum(u.n_requests for u in before if u.status == UnitStatus.DONE)
    in_flight = sum(u.n_requests for u in before if u.status == UnitStatus.RUNNING)
    restarted = time.time()
    faults.stack = up(old.run_dir, old.env)
    ready = time.time()
    figures = check_results(client, batch_id, expected)
    after = units(faults, batch_id)
    remaining = TOTAL - completed_before
    executed = _engine_requests_since(faults, restarted, at_least=remaining)
    reliability.record(
        "full_restart",
        **figures,
        server_errors=0,  # the client only polls after the restart
        completed_before_stop=completed_before,
        in_flight_at_stop=in_flight,
        reexecuted_requests=executed,
        recovery_s=first_finish_after(faults, batch_id, ready),
        restart_s=round(ready - restarted, 2),
        downtime_s=round(ready - stopped, 2),
        requests=TOTAL,
    )
    assert figures == {"lost": 0, "duplicated": 0}
    assert 0 < completed_before < TOTAL
    # units recorded before the stop kept their results; only the rest ran again
    done_before = {u.id: u.finished_at for u in before if u.status == UnitStatus.DONE}
    assert all(u.finished_at == done_before[u.id] for u in after if u.id in done_before)
    assert remaining <= executed <= remaining + in_flight


def _engine_requests_since(live: LiveStack, since: float, at_least: int, timeout: float = 60) -> int:
    """Requests the engines finished since ``since``, from their samples (flushed every few seconds:
    wait until the count reaches ``at_least`` and stops moving)."""
    database = Database(live.stack.settings.database_url)
    try:
        deadline = time.monotonic() + timeout
        last = -1
        while True:
            with database.read() as s:
                count = int(
                    s.scalar(
                        select(func.coalesce(func.sum(EngineSample.requests), 0)).where(
                            EngineSample.started_at >= since
                        )
                    )
                )
            if (count >= at_least and count == last) or time.monotonic() > deadline:
                return count
            last = count
            time.sleep(live.stack.settings.sample_seconds + 1)
    finally:
        database.dispose()
