"""Running one work unit on a warm engine, exactly once in effect.

A unit is claimed with a fresh token (compare-and-set in the database). Results are spooled to
local temporary files, published under keys that include the attempt number, and only then
recorded — again conditional on still holding the claim. A redelivered or duplicated task
therefore either finds the unit done and returns, or replaces a dead worker's claim; results of
a claim that was lost are discarded, never appended.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import update

from scheduler.lifecycle import abort_reason, finish_if_done
from storage.models import Batch, UnitStatus, WorkUnit
from storage.shards import read_shard
from storage.status import BatchStatus
from workers.engine import Engine, EngineRequest, EngineResult
from workers.results import encode, request_error_line, stopped_line, success_line
from workers.runtime import Runtime

log = logging.getLogger(__name__)

WORKER_NAME = f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class UnitTally:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Claim:
    unit_id: int
    token: str
    attempt: int
    batch_id: str
    endpoint: str
    shard_key: str
    seq: int


def claim_unit(rt: Runtime, unit_id: int, now: float) -> Claim | None:
    with rt.db.write() as s:
        unit = s.get(WorkUnit, unit_id, with_for_update=True)
        if unit is None or unit.status in UnitStatus.FINISHED:
            return None
        if unit.status == UnitStatus.RUNNING:
            return None  # a live worker has it; if it dies, the dispatcher's lease redelivers
        batch = s.get(Batch, unit.batch_id)
        if batch is None or batch.status != BatchStatus.IN_PROGRESS:
            return None  # stopping batches skip their unstarted units themselves
        token = f"{WORKER_NAME}:{secrets.token_hex(4)}"
        unit.status = UnitStatus.RUNNING
        unit.attempts += 1
        unit.worker = token
        unit.started_at = now
        unit.heartbeat_at = now
        return Claim(unit.id, token, unit.attempts, unit.batch_id, batch.endpoint, unit.shard_key, unit.seq)


class _Watch:
    """Polled by the engine between steps: says whether to stop, and heartbeats the claim.

    Reads the claim and the batch status every ``CHECK_SECONDS`` (cancellation takes effect
    within about that); writes a heartbeat only every ``heartbeat_seconds``.
    """

    CHECK_SECONDS = 1.0

    def __init__(self, rt: Runtime, claim: Claim) -> None:
        self.rt = rt
        self.claim = claim
        self.reason: str | None = None
        self.lost = False
        self._checked = 0.0
        self._beat = time.time()  # the claim itself stamped the first heartbeat

    def __call__(self) -> bool:
        now = time.time()
        if self.reason is not None or now - self._checked < self.CHECK_SECONDS:
            return self.reason is not None
        self._checked = now
        if now - self._beat >= self.rt.settings.heartbeat_seconds:
            self._beat = now
            with self.rt.db.write() as s:
                s.execute(
                    update(WorkUnit)
                    .where(WorkUnit.id == self.claim.unit_id, WorkUnit.worker == self.claim.token,
                           WorkUnit.status == UnitStatus.RUNNING)
                    .values(heartbeat_at=now)
                )  # fmt: skip
        with self.rt.db.read() as s:
            unit = s.get(WorkUnit, self.claim.unit_id)
            batch = s.get(Batch, self.claim.batch_id)
            if unit is None or unit.worker != self.claim.token or unit.status != UnitStatus.RUNNING:
                self.lost = True
                self.reason = "claim_lost"
            elif batch is not None:
                self.reason = abort_reason(batch)
        return self.reason is not None


def run_unit(rt: Runtime, engine: Engine, unit_id: int) -> UnitTally | None:
    """Run a unit if it still needs running; returns its tally, or None if there was nothing to do."""
    claim = claim_unit(rt, unit_id, time.time())
    if claim is None:
        return None
    started = time.monotonic()
    watch = _Watch(rt, claim)
    requests = (
        EngineRequest(key=row.custom_id, endpoint=claim.endpoint, body=row.body)
        for row in read_shard(rt.store, claim.shard_key)
    )
    tally = UnitTally()
    base = f"batches/{claim.batch_id}/units/{claim.seq:06d}.{claim.attempt}"
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for line, ok in _result_lines(engine.run(requests, should_abort=watch), watch, tally):
            (out if ok else err).write(encode(line))
        if watch.lost:
            log.warning("unit %s: claim lost to another worker; discarding results", unit_id)
            return None
        out.seek(0)
        err.seek(0)
        output_key, error_key = f"{base}.output.jsonl", f"{base}.errors.jsonl"
        rt.store.put_stream(output_key, out)
        rt.store.put_stream(error_key, err)
    elapsed = time.monotonic() - started
    if not _record(rt, claim, tally, output_key, error_key):
        return None
    log.info(
        "unit %s (%s #%d): %d ok, %d failed, %d prompt (%d cached) + %d output tokens in %.1fs",
        unit_id,
        claim.batch_id,
        claim.seq,
        tally.completed,
        tally.failed,
        tally.prompt_tokens,
        tally.cached_tokens,
        tally.completion_tokens,
        elapsed,
    )
    return tally


def _result_lines(
    results: Iterator[EngineResult], watch: _Watch, tally: UnitTally
) -> Iterator[tuple[dict, bool]]:
    for result in results:
        if result.status_code == 200 and result.body is not None:
            tally.completed += 1
            tally.prompt_tokens += result.prompt_tokens
            tally.cached_tokens += result.cached_tokens
            tally.completion_tokens += result.completion_tokens
            yield success_line(result.key, result.body), True
            continue
        tally.failed += 1
        code = (result.error or {}).get("code")
        if code == "aborted":
            yield stopped_line(result.key, watch.reason or "batch_cancelled"), False
        else:
            yield request_error_line(result.key, result.status_code or 500, result.error or {}), False


def _record(rt: Runtime, claim: Claim, tally: UnitTally, output_key: str, error_key: str) -> bool:
    now = time.time()
    with rt.db.write() as s:
        done = s.execute(
            update(WorkUnit)
            .where(
                WorkUnit.id == claim.unit_id,
                WorkUnit.worker == claim.token,
                WorkUnit.status == UnitStatus.RUNNING,
            )
            .values(
                status=UnitStatus.DONE,
                finished_at=now,
                heartbeat_at=now,
                completed=tally.completed,
                failed=tally.failed,
                prompt_tokens=tally.prompt_tokens,
                cached_tokens=tally.cached_tokens,
                completion_tokens=tally.completion_tokens,
                output_key=output_key,
                error_key=error_key,
            )
        ).rowcount
        if not done:
            return False
        # live progress; finalization recomputes the totals from the units
        s.execute(
            update(Batch)
            .where(Batch.id == claim.batch_id)
            .values(
                request_completed=Batch.request_completed + tally.completed,
                request_failed=Batch.request_failed + tally.failed,
                prompt_tokens=Batch.prompt_tokens + tally.prompt_tokens,
                cached_tokens=Batch.cached_tokens + tally.cached_tokens,
                completion_tokens=Batch.completion_tokens + tally.completion_tokens,
            )
        )
        batch = s.get(Batch, claim.batch_id, with_for_update=True)
        ready = batch is not None and finish_if_done(s, batch, int(now))
    if ready:
        rt.queue.finalize(claim.batch_id)
    return True
