"""Load on the live stack (issue 8): a hundred API clients polling while a job runs, and uploads of
a 200 MB file, streamed to the object store in bounded memory. The million-line upload lives in
``test_scheduler.py``, which measures the API and the control worker through that batch."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.batch_client import chat_line, read_jsonl, upload
from tests.e2e.conftest import CHAT, api_worker_pids, peak_rss_mb, peak_rss_reset, wait_final

pytestmark = [pytest.mark.stack, pytest.mark.reliability]

CLIENTS = 100
POLL_SECONDS = float(os.environ.get("FREIGHT_LOAD_SECONDS", "20"))  # bench/reliability.py runs longer
MIN_ANSWERS_PER_20_S = 8  # each client's, of the 40 it asks for: see the assert
POLL_INTERVAL = 0.5  # seconds between one client's requests, as a dashboard or SDK poller would
UPLOAD_BYTES = 200 * 1024 * 1024
API_RSS_BOUND_MB = 150  # growth of any one gunicorn worker's peak RSS over an upload


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def poll(http: httpx.AsyncClient, batch_id: str, until: float, seen: dict[str, list], me: int) -> None:
    """One client: alternate ``GET /v1/batches/{id}`` and ``GET /v1/batches`` until ``until``."""
    paths = (("retrieve", f"/batches/{batch_id}"), ("list", "/batches?limit=20"))
    turn = 0
    while time.monotonic() < until:
        name, path = paths[turn % 2]
        turn += 1
        started = time.perf_counter()
        try:
            response = await http.get(path)
        except httpx.HTTPError as exc:
            seen["failures"].append(f"{name}: {type(exc).__name__}")
        else:
            elapsed_ms = (time.perf_counter() - started) * 1000
            if response.status_code == 200:
                seen[name].append(elapsed_ms)
                seen["answers"][me] += 1
            else:
                seen["failures"].append(f"{name}: HTTP {response.status_code}")
        await asyncio.sleep(POLL_INTERVAL)


async def swarm(base_url: str, keys: list[str], batch_ids: list[str]) -> dict[str, list]:
    """CLIENTS clients polling for POLL_SECONDS, counted from when every client is made: each
    loads an SSL context (tens of milliseconds; on a loaded 2-core machine a hundred of them took
    the whole 20 s, and the window saw one request a client)."""
    clients = [
        httpx.AsyncClient(
            base_url=base_url, headers={"Authorization": f"Bearer {keys[i % len(keys)]}"}, timeout=60
        )
        for i in range(CLIENTS)
    ]
    seen: dict[str, list] = {"retrieve": [], "list": [], "failures": [], "answers": [0] * CLIENTS}
    try:
        until = time.monotonic() + POLL_SECONDS
        await asyncio.gather(
            *(poll(http, batch_ids[i % len(batch_ids)], until, seen, i) for i, http in enumerate(clients))
        )
    finally:
        await asyncio.gather(*(http.aclose() for http in clients))
    return seen


def test_a_hundred_clients_poll_while_a_job_runs(sched, reliability):
    tenants = ["alpha", "beta", "gamma"]
    clients = [sched.client(t) for t in tenants]
    per_tenant = int(15 * POLL_SECONDS)  # enough work that the batches run all through the polling
    lines = {
        t: [chat_line(f"{t}-{i}", f"Poll row {i}", max_tokens=16) for i in range(per_tenant)] for t in tenants
    }
    batches = [
        c.batches.create(input_file_id=upload(c, lines[t]), endpoint=CHAT, completion_window="24h")
        for t, c in zip(tenants, clients, strict=True)
    ]
    wait_final(clients[0], batches[0].id, timeout=300, until=("in_progress", "failed"))
    seen = asyncio.run(swarm(sched.base_url, [sched.keys[t] for t in tenants], [b.id for b in batches]))
    running = [c.batches.retrieve(b.id).status for c, b in zip(clients, batches, strict=True)]

    lost = duplicated = 0
    for tenant, client, batch in zip(tenants, clients, batches, strict=True):
        final = wait_final(client, batch.id, timeout=600)
        assert final.status == "completed", final.errors
        ids = [x["custom_id"] for x in read_jsonl(client, final.output_file_id)]
        ids += [x["custom_id"] for x in read_jsonl(client, final.error_file_id)]
        expected = {x["custom_id"] for x in lines[tenant]}
        lost += len(expected - set(ids))
        duplicated += len(ids) - len(set(ids))

    server_errors = sum(1 for f in seen["failures"] if " 5" in f)
    figures = {
        name + suffix: round(value, 1)
        for name in ("retrieve", "list")
        for suffix, value in (
            ("_p50_ms", statistics.median(seen[name])),
            ("_p99_ms", percentile(seen[name], 0.99)),
            ("_max_ms", max(seen[name])),
        )
    }
    entry = reliability.record(
        "api_load_100_clients", lost=lost, duplicated=duplicated, server_errors=server_errors,
        clients=CLIENTS, seconds=POLL_SECONDS, requests=len(seen["retrieve"]) + len(seen["list"]),
        errors=len(seen["failures"]), fewest_answers_per_client=min(seen["answers"]), failures_sample=seen["failures"][:5], **figures,
        requests_per_batch=per_tenant, batch_status_after_polling=running,
    )  # fmt: skip
    print(json.dumps(entry))
    assert not seen["failures"], seen["failures"][:10]
    assert lost == duplicated == 0
    # no client starved: each got answers all along (latency figures go to the benchmark, not
    # asserts). The fewest a client got: 162 in 120 s in the reliability benchmark's run (27 per
    # 20 s), 10 in 20 s with nine test runs loading the 2 cores (load average 20-26)
    assert min(seen["answers"]) >= MIN_ANSWERS_PER_20_S * POLL_SECONDS / 20, sorted(seen["answers"])[:10]


def write_big_jsonl(path: Path, size: int) -> tuple[int, str]:
    """Valid chat lines of about 4 KB until ``size`` bytes; returns (lines, sha256)."""
    digest = hashlib.sha256()
    filler = "lorem ipsum dolor sit amet " * 150
    count = written = 0
    with path.open("wb") as f:
        while written < size:
            line = json.dumps(chat_line(f"big-{count}", f"{count}: {filler}")).encode() + b"\n"
            f.write(line)
            digest.update(line)
            written += len(line)
            count += 1
    return count, digest.hexdigest()


def test_a_200_mb_upload_streams_in_bounded_memory(sched, reliability, tmp_path):
    client = sched.client("gamma").with_options(timeout=600)
    path = tmp_path / "big.jsonl"
    count, sha = write_big_jsonl(path, UPLOAD_BYTES)
    pids = api_worker_pids(sched.stack)
    for pid in pids:
        peak_rss_reset(pid)
    before = {pid: peak_rss_mb(pid) for pid in pids}
    started = time.monotonic()
    with path.open("rb") as f:
        uploaded = client.files.create(file=("big.jsonl", f), purpose="batch")
    upload_s = time.monotonic() - started
    growth = max(peak_rss_mb(pid) - before[pid] for pid in pids)

    assert uploaded.bytes == path.stat().st_size
    digest = hashlib.sha256()
    with client.with_streaming_response.files.content(uploaded.id) as response:
        for chunk in response.iter_bytes(1 << 20):
            digest.update(chunk)
    intact = digest.hexdigest() == sha
    client.files.delete(uploaded.id)
    entry = reliability.record(
        "upload_200mb", lost=0 if intact else 1, duplicated=0, server_errors=0,
        bytes=uploaded.bytes, lines=count, upload_s=round(upload_s, 1),
        mb_per_s=round(uploaded.bytes / 2**20 / upload_s, 1),
        api_worker_peak_rss_growth_mb=round(growth, 1), bound_mb=API_RSS_BOUND_MB,
    )  # fmt: skip
    print(json.dumps(entry))
    assert intact, "the stored object differs from the uploaded file"
    assert growth < API_RSS_BOUND_MB, entry
