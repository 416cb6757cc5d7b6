"""The scheduler against the real stack: two engine workers on one model sharing its queue,
cross-job packing, prefix-cache reuse within a tenant and none across tenants (the default
FREIGHT_PREFIX_CACHE_SHARING=tenant), a worker killed mid-pack, and a batch of a million requests
ingested, scheduled and finalized in bounded memory."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import time

import psutil
import pytest
from sqlalchemy import select

from infra.processes import engine_names
from storage.broker import make_producer, model_queue
from storage.db import Database
from storage.models import EngineSample, UnitStatus, WorkUnit
from tests.e2e.batch_client import CHAT, chat_line, read_jsonl, upload
from tests.e2e.conftest import (
    HUGE,
    LiveStack,
    api_worker_pids,
    control_worker_pids,
    peak_rss_mb,
    peak_rss_reset,
    wait_final,
)
from workers.identity import holder_of

pytestmark = pytest.mark.stack


def db(live: LiveStack) -> Database:
    return Database(live.stack.settings.database_url)


def units_of(live: LiveStack, *batch_ids: str) -> list[WorkUnit]:
    database = db(live)
    try:
        with database.read() as s:
            return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id.in_(batch_ids))).all())
    finally:
        database.dispose()


def worker_pid(unit: WorkUnit) -> int | None:
    """The process holding (or that last held) the unit: claim tokens are name:incarnation:nonce."""
    holder = holder_of(unit.worker)
    return holder.pid if holder else None


def ids_once(client, batch, expected: list[str]) -> tuple[list[dict], list[dict]]:
    output, errors = read_jsonl(client, batch.output_file_id), read_jsonl(client, batch.error_file_id)
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))
    return output, errors


def sampled_output_tokens(live: LiveStack) -> int:
    database = db(live)
    try:
        with database.read() as s:
            return sum(s.scalars(select(EngineSample.output_tokens)).all())
    finally:
        database.dispose()


def finished_output_tokens(live: LiveStack) -> int:
    database = db(live)
    try:
        with database.read() as s:
            done = s.scalars(select(WorkUnit.completion_tokens).where(WorkUnit.status == UnitStatus.DONE))
            return sum(done.all())
    finally:
        database.dispose()


SYSTEM = " ".join(f"rule {i}: answer tersely and cite the clause number {i * 7 % 13}." for i in range(40))


def small_line(custom_id: str, question: str) -> dict:
    """A chat line of 8 tokens on the long SYSTEM prompt."""
    return {
        **chat_line(custom_id, question, max_tokens=8),
        "body": {
            "model": "demo",
            "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        },
    }


def test_small_jobs_share_packs_workers_and_prefixes(sched):
    """A long job keeps both workers busy; small jobs of two other tenants, all with the same long
    system prompt, arrive meanwhile and are packed together and with it. In the default cache
    mode (tenant) each tenant's jobs read the system prompt from vLLM's prefix cache,
    and a third tenant sending the same prompt afterwards finds none of it cached."""
    alpha = sched.client("alpha")
    blocker = [chat_line(f"long-{i}", f"Item {i}", max_tokens=32, min_tokens=32) for i in range(1024)]
    big = alpha.batches.create(input_file_id=upload(alpha, blocker), endpoint=CHAT, completion_window="24h")
    wait_final(alpha, big.id, timeout=120, until=("in_progress", "failed"))
    # The small jobs arrive while no engine worker takes packs (both workers' consumers of the
    # model's queue cancelled), so they wait together as pending units behind the full queue. A
    # worker takes its next pack as soon as its feed is down to the look-ahead, so on a fast engine
    # the long job's four packs were all taken within seconds and every small job then went out as
    # a pack of its own the moment it was valid (they still met in the feed, not in a pack).
    control = make_producer(sched.stack.settings).control
    workers = [f"{name}@{socket.gethostname()}" for name in engine_names("demo", 2)]
    queue = model_queue("demo")
    # a solo worker answers between tasks: one feeding its engine answers once its feed is low
    paused = control.cancel_consumer(queue, destination=workers, reply=True, timeout=120, limit=2)
    assert len(paused) == 2, paused
    small: dict[str, tuple[object, list[str]]] = {}
    tenant_of: dict[str, str] = {}
    for tenant in ("beta", "gamma", "beta", "gamma", "beta", "gamma"):
        client = sched.client(tenant)
        lines = [
            small_line(f"{tenant}-{len(small)}-{i}", f"Question {i} of job {len(small)}") for i in range(10)
        ]
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
        )
        small[batch.id] = (client, [x["custom_id"] for x in lines])
        tenant_of[batch.id] = tenant
    for bid, (client, _) in small.items():  # validated: their units pending (or one pack queued)
        assert wait_final(client, bid, timeout=120, until=("in_progress", "failed")).status == "in_progress"
    resumed = control.add_consumer(queue, destination=workers, reply=True, timeout=60, limit=2)
    assert len(resumed) == 2, resumed
    finals = {bid: wait_final(client, bid, timeout=300) for bid, (client, _) in small.items()}
    big_final = wait_final(alpha, big.id, timeout=300)
    assert big_final.status == "completed" and big_final.request_counts.completed == len(blocker)
    ids_once(alpha, big_final, [x["custom_id"] for x in blocker])
    for bid, (client, expected) in small.items():
        assert finals[bid].status == "completed", finals[bid]
        output, errors = ids_once(client, finals[bid], expected)
        assert not errors and len(output) == 10

    units = units_of(sched, big.id, *small)
    by_pack: dict[str, set[str]] = {}
    for unit in units:
        assert unit.status == UnitStatus.DONE and unit.pack_id
        by_pack.setdefault(unit.pack_id, set()).add(unit.batch_id)
    # cross-job packing: some pack ran units of several small batches. Not necessarily of both
    # tenants: in the default cache mode the packer sorts units by cache domain (the tenant's salt)
    # before the prompt key, so two tenants' units share a pack only where a pack's cut falls
    # between them (a full run of the suite once had none that did; scheduler/packing.plan_packs)
    mixed = [p for p in by_pack.values() if len(p & set(small)) >= 2]
    assert mixed, by_pack
    # both worker processes ran units of the long job
    assert len({worker_pid(u) for u in units if u.batch_id == big.id}) == 2
    # the shared system prompt was computed once per tenant (and engine) and then read from vLLM's
    # prefix cache by that tenant's other lines
    cached = sum(finals[bid].usage.input_tokens_details.cached_tokens for bid in small)
    for tenant in ("beta", "gamma"):
        mine = [bid for bid in small if tenant_of[bid] == tenant]
        tenant_cached = sum(finals[bid].usage.input_tokens_details.cached_tokens for bid in mine)
        tenant_prompt = sum(finals[bid].usage.input_tokens for bid in mine)
        print(f"{tenant}: {tenant_cached} of {tenant_prompt} prompt tokens cached")
        assert tenant_cached > 0.5 * tenant_prompt, (tenant, tenant_cached, tenant_prompt)
    assert sum(u.cached_tokens for u in units if u.batch_id in small) == cached
    # not across tenants: alpha's line on the same system prompt, sent once beta's and gamma's are
    # cached on both engines, finds none of it (vLLM's cache_salt differs in the first block)
    probe_line = small_line("alpha-probe", "Question 0 of job 0")
    probe = alpha.batches.create(
        input_file_id=upload(alpha, [probe_line]), endpoint=CHAT, completion_window="24h"
    )
    probe_final = wait_final(alpha, probe.id, timeout=120)
    assert probe_final.status == "completed", probe_final
    (probe_out,) = read_jsonl(alpha, probe_final.output_file_id)
    probe_usage = probe_out["response"]["body"]["usage"]
    assert probe_usage["prompt_tokens"] > 256, probe_usage  # the system prompt is many KV blocks
    print(f"alpha's line on the same prompt: {probe_usage['prompt_tokens_details']['cached_tokens']} of "
          f"{probe_usage['prompt_tokens']} prompt tokens cached")  # fmt: skip
    assert probe_usage["prompt_tokens_details"]["cached_tokens"] == 0, probe_usage
    # batch fill is recorded per unit and as a time series
    assert all(u.mean_fill is not None and 0 < u.mean_fill <= 1 for u in units if u.batch_id == big.id)
    # every output token the engines produced is in exactly one sample: on this shared stack,
    # the samples add up to the output of all finished units so far (no test before this stops one)
    output_tokens = big_final.usage.output_tokens + sum(finals[b].usage.output_tokens for b in small)
    assert sum(u.completion_tokens for u in units) == output_tokens  # (a small request may stop at EOS)
    deadline = time.monotonic() + 60  # the last period's sample is written when the period ends
    while sampled_output_tokens(sched) != finished_output_tokens(sched) and time.monotonic() < deadline:
        time.sleep(1)
    assert sampled_output_tokens(sched) == finished_output_tokens(sched)
    database = db(sched)
    try:
        with database.read() as s:
            samples = s.scalars(select(EngineSample)).all()
    finally:
        database.dispose()
    assert len({x.worker for x in samples}) == 2
    assert all(0 <= x.running_mean <= x.max_num_seqs and x.seconds > 0 for x in samples)
    assert max(x.running_mean for x in samples) > 0.5 * samples[0].max_num_seqs  # the engines ran full


def test_killed_worker_loses_no_work(sched):
    client = sched.client("alpha")
    lines = [chat_line(f"kill-{i}", f"Row {i}", max_tokens=48, min_tokens=48) for i in range(768)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    victim_pid = int((sched.stack.run_dir / "engine-demo-2.pid").read_text())
    deadline = time.monotonic() + 240
    while True:  # wait until the victim holds running units of this batch
        running = [u for u in units_of(sched, batch.id) if u.status == UnitStatus.RUNNING]
        if any(worker_pid(u) == victim_pid for u in running):
            break
        assert time.monotonic() < deadline, "the second worker never took a unit"
        time.sleep(0.2)
    os.killpg(victim_pid, signal.SIGKILL)  # the worker and vLLM's engine process with it
    final = wait_final(client, batch.id, timeout=400)
    assert final.status == "completed" and final.request_counts.completed == len(lines)
    _, errors = ids_once(client, final, [x["custom_id"] for x in lines])
    assert not errors
    units = units_of(sched, batch.id)
    assert any(u.attempts >= 2 for u in units)  # redelivered after the lease ran out
    assert all(u.status == UnitStatus.DONE for u in units)
    assert all(worker_pid(u) != victim_pid for u in units if u.attempts >= 2)


def test_request_counts_move_within_a_unit(sched):
    """request_counts come from the running units' heartbeats too, not only from finished units."""
    client = sched.client("beta")
    # one unit (FREIGHT_UNIT_SIZE=64) of two waves of 32 sequences (max_num_seqs): the first
    # wave's results are known seconds before the unit ends
    lines = [
        chat_line(f"live-{i}", f"Progress row {i}", max_tokens=320, min_tokens=320, ignore_eos=True)
        for i in range(64)
    ]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    seen: set[int] = set()
    listed: set[int] = set()
    deadline = time.monotonic() + 300
    while True:
        current = client.batches.retrieve(batch.id)
        if current.status in ("completed", "failed", "expired", "cancelled"):
            break
        if current.status == "in_progress":
            seen.add(current.request_counts.completed)
            if 0 < current.request_counts.completed < len(lines):
                page = client.batches.list(limit=100)
                listed |= {b.request_counts.completed for b in page.data if b.id == batch.id}
        assert time.monotonic() < deadline, f"batch still {current.status}"
        time.sleep(0.2)
    assert current.status == "completed" and current.request_counts.completed == len(lines)
    assert len(units_of(sched, batch.id)) == 1
    partial = sorted(n for n in seen if 0 < n < len(lines))
    assert partial, f"progress only ever showed {sorted(seen)}"
    assert any(0 < n < len(lines) for n in listed)  # the list endpoint shows the same live counts
    assert seen <= set(range(len(lines) + 1))


def _digest(custom_id: str) -> bytes:
    return hashlib.blake2b(custom_id.encode(), digest_size=8).digest()


@pytest.mark.reliability
def test_a_million_requests_in_bounded_memory(sched, tmp_path, reliability):
    client = sched.client("beta").with_options(timeout=600)
    path = tmp_path / "huge.jsonl"
    # the factory's line with its two fields filled in by formatting (json.dumps of each of the
    # million lines took 4.8 CPU-s); ids and texts hold nothing JSON would escape
    head, rest = json.dumps(chat_line("@ID@", "@TEXT@", max_tokens=1)).split("@ID@")
    middle, tail = rest.split("@TEXT@")
    with path.open("w") as f:
        for i in range(HUGE):
            f.write(f"{head}r{i}{middle}Label {i % 997}: row {i}{tail}\n")
    control = control_worker_pids(sched.stack)  # the supervisor, its roles and their pools
    for pid in control:
        peak_rss_reset(pid)
    control_before = {pid: peak_rss_mb(pid) for pid in control}
    api = api_worker_pids(sched.stack)
    for pid in api:
        peak_rss_reset(pid)
    api_before = {pid: peak_rss_mb(pid) for pid in api}
    with path.open("rb") as f:
        file_id = client.files.create(file=("huge.jsonl", f), purpose="batch").id
    api_growth = max(peak_rss_mb(pid) - api_before[pid] for pid in api)
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    running = wait_final(client, batch.id, timeout=1200, until=("in_progress", "failed"))
    assert running.status == "in_progress" and running.request_counts.total == HUGE, running.errors
    deadline = time.monotonic() + 300
    while client.batches.retrieve(batch.id).request_counts.completed < 500:
        assert time.monotonic() < deadline, "no requests of the huge batch ran"
        time.sleep(1)
    client.batches.cancel(batch.id)
    final = wait_final(client, batch.id, timeout=900)
    assert final.status == "cancelled"
    # the most any one of them grew (the validation and finalization pools do the work)
    before, peak = max(
        ((control_before[pid], peak_rss_mb(pid)) for pid in control), key=lambda b: b[1] - b[0]
    )
    seen: set[bytes] = set()
    counts = {"output": 0, "errors": 0}
    for name, file_id in (("output", final.output_file_id), ("errors", final.error_file_id)):
        with client.with_streaming_response.files.content(file_id) as response:
            for line in response.iter_lines():
                if line:
                    record = json.loads(line)
                    seen.add(_digest(record["custom_id"]))
                    counts[name] += 1
                    if name == "output":
                        assert record["response"]["status_code"] == 200
                    else:
                        assert record["error"]["code"] == "batch_cancelled"
    reliability.record(
        "upload_1m_lines", lost=HUGE - len(seen), duplicated=counts["output"] + counts["errors"] - len(seen),
        server_errors=0, lines=HUGE, bytes=path.stat().st_size, completed=counts["output"],
        cancelled=counts["errors"], control_worker_peak_rss_growth_mb=round(peak - before, 1),
        api_worker_peak_rss_growth_mb=round(api_growth, 1), bound_mb=400,
    )  # fmt: skip
    assert counts["output"] + counts["errors"] == HUGE == len(seen)  # every request exactly once
    assert counts["output"] == final.request_counts.completed >= 500
    # the control worker validated, sorted and assembled ~200 MB of JSONL within a bounded window
    print(f"control worker peak RSS {before:.0f} MB before, {peak:.0f} MB during the million-request batch")
    assert peak - before < 400, (before, peak)
    assert api_growth < 150, api_growth  # the upload streamed to the object store


def test_a_tenant_of_n128_lines_does_not_crowd_out_one_of_single_lines(sched):
    """Issue #49 part 4, live: the shares count work, not lines. Tenant alpha's lines ask for 128
    sequences each, beta's for one; beta's batch and then alpha's are validated while the workers'
    consumers are paused, as above. Shared by lines, alpha's two units went out in one pass;
    weighed by work, alpha's first unit (64 lines of 128 sequences, the work of many of beta's
    units) holds alpha's share, and beta's units go on beside it."""
    heavy_client, light_client = sched.client("alpha"), sched.client("beta")
    control = make_producer(sched.stack.settings).control
    # the workers still running: test_killed_worker_loses_no_work, before this one, killed the second
    workers = [
        f"{name}@{socket.gethostname()}"
        for name in engine_names("demo", 2)
        if _running(int((sched.stack.run_dir / f"{name}.pid").read_text()))
    ]
    queue = model_queue("demo")
    paused = control.cancel_consumer(queue, destination=workers, reply=True, timeout=120, limit=len(workers))
    try:  # whatever fails here, the workers take packs again after it
        assert workers and len(paused) == len(workers), (workers, paused)
        heavy_lines = [chat_line(f"n128-{i}", f"Many {i}", max_tokens=2, n=128) for i in range(66)]
        light_lines = [chat_line(f"n1-{i}", f"One {i}", max_tokens=2) for i in range(1024)]
        # beta's first: the workers' asks, still live while paused, may have packs of its made at
        # once (as many as there are asks); alpha's then arrives to a queue that waits
        made = []
        for client, lines in ((light_client, light_lines), (heavy_client, heavy_lines)):
            batch = client.batches.create(
                input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
            )
            assert (
                wait_final(client, batch.id, timeout=120, until=("in_progress", "failed")).status
                == "in_progress"
            )
            made.append(batch)
        light, heavy = made
    finally:
        resumed = control.add_consumer(queue, destination=workers, reply=True, timeout=60, limit=len(workers))
    assert len(resumed) == len(workers), resumed
    light_final = wait_final(light_client, light.id, timeout=300)
    assert light_final.status == "completed" and light_final.request_counts.completed == len(light_lines)
    heavy_final = wait_final(heavy_client, heavy.id, timeout=300)
    assert heavy_final.status == "completed" and heavy_final.request_counts.completed == len(heavy_lines)
    first, second = sorted(units_of(sched, heavy.id), key=lambda u: u.seq)
    assert (first.sequences, second.sequences) == (64 * 128, 2 * 128)
    light_units = units_of(sched, light.id)
    assert len(light_units) == 16 and {u.sequences for u in light_units} == {64}
    # work: the prompt once and 2 tokens for each sequence
    assert first.work == first.planned_prompt_tokens + 64 * 128 * 2
    assert all(u.work == u.planned_prompt_tokens + 64 * 2 for u in light_units)
    assert first.work > 8 * max(u.work for u in light_units)
    assert first.enqueued_at is not None
    second_at = second.enqueued_at if second.enqueued_at is not None else float("inf")
    beside = [
        u for u in light_units if u.enqueued_at is not None and first.enqueued_at <= u.enqueued_at < second_at
    ]
    print(f"n=128 unit work {first.work}, n=1 unit work {max(u.work for u in light_units)}; "
          f"{len(beside)} of beta's 16 units packed from alpha's first unit to its second")  # fmt: skip
    # by lines: alpha's second unit in the same pass as its first, none of beta's between
    assert second.pack_id != first.pack_id and len(beside) >= 3, (first.enqueued_at, second_at, len(beside))


def _running(pid: int) -> bool:
    """Whether the process lives (a killed one this test process has not reaped is a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
