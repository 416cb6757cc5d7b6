"""Faults of the engine workers and the object store, on the real stack (issue 8).

One stack for the module: two engine workers on the demo model and an S3 object store on a
SeaweedFS of the module's own, so the store can be stopped and started again. Each scenario checks
that every ``custom_id`` of its batch ends in exactly one of the output and error files, and
records its figures through the ``reliability`` fixture.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from api.services.monitoring import metrics_snapshot
from infra import daemons as services
from infra.processes import engine_names
from storage.db import Database
from storage.models import Batch, EngineSample, UnitStatus, WorkUnit
from storage.runtime import Runtime
from tests.e2e.batch_client import CHAT, chat_line, long_lines, read_jsonl, tally, upload
from tests.e2e.conftest import LiveStack, keep_logs, start_live, wait_final
from workers.identity import Holder, holder_of

pytestmark = [pytest.mark.stack, pytest.mark.reliability]

DRAIN_SECONDS = 5
SHUTDOWN_GRACE_SECONDS = 40  # after the drain: hand-back, threads, vLLM's engine process, Celery
WORKERS = engine_names("demo", 2)
RETRY_LINE = re.compile(rb"object store: .* failed \(try \d+ of \d+\)")


@dataclass
class Faults:
    live: LiveStack
    weed: services.S3Service
    weed_dir: Path
    bucket: str

    @property
    def stack(self):
        return self.live.stack

    def db(self) -> Database:
        return Database(self.stack.settings.database_url)

    def pid(self, name: str) -> int:
        return int((self.stack.run_dir / f"{name}.pid").read_text().split()[0])

    def ensure_workers(self) -> None:
        """Start again any engine worker an earlier scenario stopped."""
        for name in WORKERS:
            proc = self.stack.processes[name]
            if proc.poll() is not None:
                self.stack.start_process(name)

    def log_sizes(self) -> dict[str, int]:
        return {p.name: p.stat().st_size for p in self.stack.run_dir.glob("*.log")}

    def retries_since(self, sizes: dict[str, int]) -> int:
        total = 0
        for path in self.stack.run_dir.glob("*.log"):
            with open(path, "rb") as f:
                f.seek(sizes.get(path.name, 0))
                total += len(RETRY_LINE.findall(f.read()))
        return total


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Faults]:
    weed_dir = tmp_path_factory.mktemp("faults-weed")
    weed = services.start_seaweedfs(weed_dir, services.free_port())
    try:
        bucket = weed.create_bucket(f"faults-{uuid.uuid4().hex[:8]}")
        overrides = {
            "FREIGHT_OBJECT_STORE_URL": f"s3://{bucket}/freight",
            "FREIGHT_S3_ENDPOINT_URL": weed.endpoint_url,
            "AWS_ACCESS_KEY_ID": weed.access_key,
            "AWS_SECRET_ACCESS_KEY": weed.secret_key,
            "AWS_DEFAULT_REGION": weed.region,
            "FREIGHT_COMPLETION_WINDOWS": "24h",
            "FREIGHT_UNIT_SIZE": "16",
            "FREIGHT_PACK_REQUESTS": "64",
            "FREIGHT_HEARTBEAT_SECONDS": "1",
            "FREIGHT_LEASE_SECONDS": "8",
            "FREIGHT_DRAIN_SECONDS": str(DRAIN_SECONDS),
            "FREIGHT_OBJECT_STORE_RETRY_SECONDS": "120",
        }
        live, stack = start_live(
            tmp_path_factory.mktemp("faults"), demo_model, overrides, ("alpha",), workers_per_model=2
        )
        try:
            yield Faults(live, weed, weed_dir, bucket)
        finally:
            keep_logs(stack, "faults")
    finally:
        services.stop_all(weed_dir)


# ---------------------------------------------------------------------------------------- helpers


def units_of(f: Faults, batch_id: str) -> list[WorkUnit]:
    database = f.db()
    try:
        with database.read() as s:
            return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id)).all())
    finally:
        database.dispose()


def batch_row(f: Faults, batch_id: str) -> Batch:
    database = f.db()
    try:
        with database.read() as s:
            row = s.get(Batch, batch_id)
            assert row is not None
            s.expunge(row)
            return row
    finally:
        database.dispose()


def holder_pid(unit: WorkUnit) -> int | None:
    holder = holder_of(unit.worker)  # claim tokens are name:incarnation:nonce, the pid in the incarnation
    return holder.pid if holder else None


def wait_held_by(f: Faults, batch_id: str, pid: int, timeout: float = 300) -> Holder:
    """Wait until process ``pid`` holds a running unit of the batch; whose claim it is."""
    deadline = time.monotonic() + timeout
    while True:
        units = units_of(f, batch_id)
        held = [u for u in units if u.status == UnitStatus.RUNNING and holder_pid(u) == pid]
        if held and (holder := holder_of(held[0].worker)):
            return holder
        assert time.monotonic() < deadline, f"worker {pid} never took a unit of {batch_id}"
        time.sleep(0.2)


def check_usage_and_cost(f: Faults, final, output: list[dict]) -> None:
    """The batch's usage is the sum over its output lines, and its cost the sum over its units,
    each unit once (a killed or released attempt records nothing)."""
    prompt = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in output)
    completion = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in output)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, completion)
    units = units_of(f, final.id)
    assert len({u.id for u in units}) == len(units) and all(u.status == UnitStatus.DONE for u in units)
    assert sum(u.completed for u in units) == len(output)
    assert sum(u.prompt_tokens for u in units) == prompt
    assert sum(u.completion_tokens for u in units) == completion
    row = batch_row(f, final.id)
    assert row.cost_micros == sum(u.cost_micros for u in units) > 0
    assert row.engine_seconds == pytest.approx(sum(u.engine_seconds for u in units))
    assert (row.prompt_tokens, row.completion_tokens) == (prompt, completion)


# ---------------------------------------------------------------------------------------- scenarios


def test_engine_rejecting_one_request_fails_it_alone(faults: Faults, reliability) -> None:
    """A prompt longer than the model's context and an output budget beyond it reach the engine
    (validation does not know the context) inside one unit with good requests: those two get
    400 error lines naming the reason, the others succeed."""
    client = faults.live.client()
    too_long = "lorem ipsum dolor " * 2000  # ~6,000 tokens against a 2,048-token context
    lines = [
        chat_line("ok-0", "Hello"),
        chat_line("too-long", too_long, max_tokens=4),
        chat_line("ok-1", "Good morning"),
        chat_line("huge-budget", "Write forever", max_tokens=10**6),
        chat_line("ok-2", "Bye"),
    ]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    final = wait_final(client, batch.id, timeout=300)
    assert final.status == "completed", final.errors
    output, errors = read_jsonl(client, final.output_file_id), read_jsonl(client, final.error_file_id)
    counts = tally(output, errors, [x["custom_id"] for x in lines])
    server_errors = sum(1 for x in errors if (x["response"] or {}).get("status_code", 0) >= 500)
    reliability.record(
        "engine_request_error", **counts, server_errors=server_errors, requests=len(lines),
        failed_requests=len(errors), ok_requests=len(output),
    )  # fmt: skip
    assert counts == {"lost": 0, "duplicated": 0} and server_errors == 0
    assert sorted(x["custom_id"] for x in output) == ["ok-0", "ok-1", "ok-2"]
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in output)
    assert len(units_of(faults, batch.id)) == 1  # the bad requests shared a unit with the good ones
    by_id = {x["custom_id"]: x for x in errors}
    assert set(by_id) == {"too-long", "huge-budget"}
    for custom_id, line in by_id.items():
        assert line["response"]["status_code"] == 400 and line["error"] is None, line
        error = line["response"]["body"]["error"]
        assert error["type"] == "invalid_request_error" and error["message"], line
        if custom_id == "too-long":
            assert error["code"] == "context_length_exceeded" and "2048" in error["message"], line
        else:
            assert error["param"] == "max_tokens" and "2048" in error["message"], line
    assert final.request_counts.completed == 3 and final.request_counts.failed == 2


def test_object_store_outage_while_results_are_written(faults: Faults, reliability) -> None:
    """SeaweedFS stops while units are being recorded and starts again seconds later: the writes
    retry with backoff, the batch completes exactly, and no partial object was ever published."""
    faults.ensure_workers()
    client = faults.live.client()
    lines = long_lines("s3", 160, tokens=32)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 300
    while not any(u.status == UnitStatus.DONE for u in units_of(faults, batch.id)):  # results being written
        assert time.monotonic() < deadline, "no unit finished"
        time.sleep(0.2)
    sizes = faults.log_sizes()
    down = time.monotonic()
    faults.weed.stop()
    try:
        time.sleep(5)  # the outage; units finish meanwhile and their writes wait for the store
    finally:
        faults.weed = services.start_seaweedfs(
            faults.weed_dir, int(faults.weed.endpoint_url.rsplit(":", 1)[1])
        )
    outage_s = time.monotonic() - down
    final = wait_final(client, batch.id, timeout=400)
    retries = faults.retries_since(sizes)
    output, errors = read_jsonl(client, final.output_file_id), read_jsonl(client, final.error_file_id)
    counts = tally(output, errors, [x["custom_id"] for x in lines])

    # no partial object: every recorded unit's files hold exactly the lines the unit recorded, the
    # batch's files exactly its counts, and no upload is left open
    s3 = faults.weed.client()
    partial = 0
    for unit in units_of(faults, batch.id):
        for key, n in ((unit.output_key, unit.completed), (unit.error_key, unit.failed)):
            body = s3.get_object(Bucket=faults.bucket, Key=f"freight/{key}")["Body"].read()
            partial += body.count(b"\n") != n or bool(body and not body.endswith(b"\n"))
            for raw in body.splitlines():
                json.loads(raw)
    partial += len(output) != final.request_counts.completed
    open_uploads = s3.list_multipart_uploads(Bucket=faults.bucket).get("Uploads", [])
    reliability.record(
        "object_store_outage", **counts, server_errors=0, requests=len(lines), outage_s=round(outage_s, 1),
        retries=retries, partial_files_published=partial, open_uploads=len(open_uploads),
    )  # fmt: skip
    assert final.status == "completed" and final.request_counts.completed == len(lines), final
    assert counts == {"lost": 0, "duplicated": 0} and not errors
    assert partial == 0 and not open_uploads
    assert retries >= 1  # the outage was met, and ridden out by retrying
    check_usage_and_cost(faults, final, output)


def test_sigkilled_worker_unit_is_redelivered_once(faults: Faults, reliability) -> None:
    faults.ensure_workers()
    client = faults.live.client()
    lines = long_lines("kill", 256)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    victim = WORKERS[1]
    pid = faults.pid(victim)
    wait_held_by(faults, batch.id, pid)
    killed = time.monotonic()
    os.killpg(pid, signal.SIGKILL)  # the worker and vLLM's engine process with it
    faults.stack.processes[victim].wait(30)
    final = wait_final(client, batch.id, timeout=600)
    recovery_s = time.monotonic() - killed
    output, errors = read_jsonl(client, final.output_file_id), read_jsonl(client, final.error_file_id)
    counts = tally(output, errors, [x["custom_id"] for x in lines])
    units = units_of(faults, batch.id)
    redelivered = [u for u in units if u.attempts >= 2]
    reliability.record(
        "worker_sigkill", **counts, server_errors=0, requests=len(lines),
        redelivered_units=len(redelivered), recovery_s=round(recovery_s, 1),
    )  # fmt: skip
    assert final.status == "completed" and final.request_counts.completed == len(lines), final
    assert counts == {"lost": 0, "duplicated": 0} and not errors
    assert redelivered and all(holder_pid(u) != pid for u in redelivered)
    check_usage_and_cost(faults, final, output)


def test_a_restarted_worker_keeps_its_name(faults: Faults) -> None:
    """A worker started again under the same ``--name`` (``engine-demo-2@%h``, as infra.processes
    starts it) reports under the same ``worker`` label: its claims and its engine samples name it,
    and /metrics' worker series stay one per worker instead of one per process. Only the
    incarnation in its claim tokens is new, so it is never taken for its predecessor. After the
    SIGKILL scenario the predecessor is that scenario's killed process (its claims are still in the
    database), and the restart is the one the next scenario would make anyway."""
    victim = WORKERS[1]
    label = f"{victim}@{socket.gethostname()}"
    labels = {f"{name}@{socket.gethostname()}" for name in WORKERS}
    client = faults.live.client()

    def run_on_victim(tag: str) -> Holder:
        batch = client.batches.create(
            input_file_id=upload(client, long_lines(tag, 128, tokens=16)),
            endpoint=CHAT,
            completion_window="24h",
        )
        holder = wait_held_by(faults, batch.id, faults.pid(victim))
        assert wait_final(client, batch.id, timeout=300).status == "completed"
        return holder

    dead_pid = faults.pid(victim)  # the pid file names the last process started, dead or alive
    database = faults.db()
    try:
        with database.read() as s:
            claims = s.scalars(select(WorkUnit.worker).where(WorkUnit.worker.is_not(None))).all()
            sampled = s.scalar(select(func.count()).where(EngineSample.worker == label))
        before = next((h for t in claims if (h := holder_of(t)) and h.pid == dead_pid), None)
        if faults.stack.processes[victim].poll() is None or before is None or not sampled:
            # run alone (or nothing of the dead one's to compare with): make a predecessor
            faults.ensure_workers()
            before = run_on_victim("name-before")
            os.kill(faults.pid(victim), signal.SIGTERM)  # a graceful stop, as a supervisor's restart
            faults.stack.processes[victim].wait(DRAIN_SECONDS + SHUTDOWN_GRACE_SECONDS)
        restarted = time.time()
        faults.ensure_workers()
        after = run_on_victim("name-after")
        assert before.worker == after.worker == label
        assert before.incarnation != after.incarnation and before.pid != after.pid
        with open(faults.stack.log(victim), "rb") as f:
            f.seek(faults.stack.log_offsets[victim])  # the restarted process's lines name it too
            assert f" [{label}] ".encode() in f.read()
        # the restarted process's engine samples join its predecessor's series (written each
        # FREIGHT_SAMPLE_SECONDS of engine work: the last one shortly after the batch)
        deadline = time.monotonic() + 30
        while True:
            with database.read() as s:
                samples = s.execute(select(EngineSample.worker, EngineSample.started_at)).all()
            mine = [at for worker, at in samples if worker == label]
            if any(at >= restarted for at in mine) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert any(at < restarted for at in mine) and any(at >= restarted for at in mine), mine
        assert {worker for worker, _ in samples} <= labels
        rt = Runtime(faults.stack.settings)  # what /metrics reads: one series per worker name
        try:
            busy = metrics_snapshot(rt, time.time()).engine_busy_seconds
        finally:
            rt.db.dispose()
        assert (label, "demo") in busy and {worker for worker, _ in busy} <= labels, busy
    finally:
        database.dispose()


def test_a_killed_worker_leaves_no_process_behind(faults: Faults) -> None:
    """SIGKILL to the worker process alone (the OOM killer, ``kill -9 PID``, a supervisor that
    kills only its main process): nothing it started lives on holding the engine's memory. On this
    CPU the engine core runs inline, in the worker's own process (FREIGHT_ENGINE_CORE=auto); an
    engine core of its own is tested in tests/workers/test_engine_lifetime.py."""
    faults.ensure_workers()
    victim = WORKERS[1]
    pid = faults.pid(victim)
    children = psutil.Process(pid).children(recursive=True)
    assert not [p for p in children if p.name().startswith("VLLM::")], children  # the core is inline
    os.kill(pid, signal.SIGKILL)
    faults.stack.processes[victim].wait(30)
    _, alive = psutil.wait_procs(children, timeout=30)
    for orphan in alive:
        orphan.kill()
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_sigterm_drains_within_its_bound(faults: Faults, reliability) -> None:
    """SIGTERM to a worker holding units (as ``kill``, Docker and Kubernetes send it): it takes no
    new pack, lets its units run for FREIGHT_DRAIN_SECONDS, hands the rest back for the other
    worker to run at once (no lease expiry: attempts stay 1), and exits 0 within the bound."""
    faults.ensure_workers()
    client = faults.live.client()
    lines = long_lines("term", 256, tokens=64)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    victim = WORKERS[1]
    pid = faults.pid(victim)
    wait_held_by(faults, batch.id, pid)
    log = faults.stack.log(victim)
    offset = log.stat().st_size
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    bound_s = DRAIN_SECONDS + SHUTDOWN_GRACE_SECONDS
    try:
        exit_code = faults.stack.processes[victim].wait(bound_s)
    except Exception:
        exit_code = None
    drain_s = time.monotonic() - sent
    if exit_code is None:
        os.killpg(pid, signal.SIGKILL)
    final = wait_final(client, batch.id, timeout=600)
    with open(log, "rb") as f:
        f.seek(offset)
        released = f.read().count(b"released unfinished at shutdown")
    output, errors = read_jsonl(client, final.output_file_id), read_jsonl(client, final.error_file_id)
    counts = tally(output, errors, [x["custom_id"] for x in lines])
    units = units_of(faults, batch.id)
    reliability.record(
        "worker_sigterm", **counts, server_errors=0, requests=len(lines), drain_s=round(drain_s, 1),
        bound_s=bound_s, exit_code=exit_code, released_units=released,
    )  # fmt: skip
    assert exit_code == 0 and drain_s <= bound_s, (exit_code, drain_s)
    assert final.status == "completed" and final.request_counts.completed == len(lines), final
    assert counts == {"lost": 0, "duplicated": 0} and not errors
    assert all(u.attempts == 1 for u in units), [(u.id, u.attempts) for u in units]  # handed back
    check_usage_and_cost(faults, final, output)


# ------------------------------------------------------------ results while a batch runs (#48)


def poll_results(client, batch_id: str, cursor: str, **query: str) -> tuple[list[bytes], str, bool]:
    """GET /v1/batches/{id}/results after ``cursor`` with the official client's plain HTTP: the
    new lines, the next cursor, and whether no more will come."""
    import httpx2

    response = client.get(
        f"/batches/{batch_id}/results",
        cast_to=httpx2.Response,
        options={"params": {"after": cursor, **query}},
    )
    complete = response.headers["x-freight-results-complete"] == "true"
    return response.content.splitlines(keepends=True), response.headers["x-freight-next-cursor"], complete


def poll_until_complete(client, batch_id: str, while_polling=None) -> tuple[list[bytes], int]:
    """Every output line the results route gives over polls until it says complete; and how many
    of them were read while the batch was still running."""
    seen: list[bytes] = []
    early = 0
    cursor = ""
    deadline = time.monotonic() + 600
    while True:
        status = client.batches.retrieve(batch_id).status
        lines, cursor, complete = poll_results(client, batch_id, cursor)
        seen += lines
        early += len(lines) if status == "in_progress" else 0
        if while_polling is not None:
            while_polling(seen)
        if complete:
            return seen, early
        assert time.monotonic() < deadline, f"results of {batch_id} never complete"
        time.sleep(0.3)


def test_results_polled_while_a_batch_runs_are_its_final_lines(faults: Faults) -> None:
    """Lines read from the results route while the batch runs are, byte for byte, the lines of its
    final output file, each once; the input-order download holds the same lines in input order."""
    faults.ensure_workers()
    client = faults.live.client()
    lines = long_lines("partial", 160, tokens=32)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    seen, early = poll_until_complete(client, batch.id)
    final = wait_final(client, batch.id, timeout=300)
    assert final.status == "completed", final.errors
    output = client.files.content(final.output_file_id).content.splitlines(keepends=True)
    assert early > 0  # results were read before the batch ended
    assert sorted(seen) == sorted(output) and len(set(seen)) == len(seen) == len(lines)
    ordered = client.files.content(final.output_file_id, extra_query={"order": "input"}).content
    assert ordered.splitlines(keepends=True) == sorted(
        output, key=lambda x: int(json.loads(x)["custom_id"].rsplit("-", 1)[1])
    )
    again, _, complete = poll_results(client, batch.id, "", order="input")
    assert complete and b"".join(again) == ordered


def test_partial_reads_around_a_killed_worker_never_show_a_replaced_line(faults: Faults) -> None:
    """A worker SIGKILLed mid-run while a client polls for results: its unit runs again on the
    other worker, and no line read before, during or after is missing from the final file or
    different there (a lost attempt's lines, with their own ids, are never served)."""
    faults.ensure_workers()
    client = faults.live.client()
    lines = long_lines("kill-partial", 256)
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    victim = WORKERS[1]
    pid = faults.pid(victim)
    killed: list[bool] = []

    def kill_once_held(seen: list[bytes]) -> None:
        if killed:
            return
        wait_held_by(faults, batch.id, pid)
        os.killpg(pid, signal.SIGKILL)  # the worker and vLLM's engine process with it
        faults.stack.processes[victim].wait(30)
        killed.append(True)

    seen, _ = poll_until_complete(client, batch.id, kill_once_held)
    final = wait_final(client, batch.id, timeout=600)
    assert final.status == "completed" and final.request_counts.completed == len(lines), final
    output = client.files.content(final.output_file_id).content.splitlines(keepends=True)
    assert set(seen) <= set(output)  # nothing read was replaced later
    assert sorted(seen) == sorted(output) and len(set(seen)) == len(seen) == len(lines)
    redelivered = [u for u in units_of(faults, batch.id) if u.attempts >= 2]
    assert redelivered and all(holder_pid(u) != pid for u in redelivered)
