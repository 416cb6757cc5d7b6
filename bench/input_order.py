"""A million-line output file downloaded in input order (issue #48 part 5): time and peak memory.

    python -m bench.input_order [--requests 1000000] [--stores s3|local|local,s3] [--out FILE]

``GET /v1/files/{id}/content?order=input`` reads a batch's output file (prompt-sorted: the units
in seq order, each unit's lines as its requests finished), finds each line's input line from the
batch's shards, and streams the lines back in input order through an external sort
(``storage/result_order.py``: 64 MB of lines in memory, sorted runs spilled to local disk beyond).
No engine runs: the batch is written as validation and the engine workers leave it, at realistic
sizes (``bench.finalization.output_line``: ~790-byte chat completion lines, units of 256 requests,
shards of 64 units, the input lines in a seeded random order across them: the prompt sort bears
no relation to the input order, the sort's worst case), and finalized by ``finalize_batch``.

The batch is written and finalized first (on a SQLite database and the local store or a SeaweedFS
of its own); then the API starts as ``make run`` starts it (``freight api``: gunicorn, 2 workers of
4 threads) on the same database and store, and the download is an HTTP request from this process,
which only counts the bytes and checks the order. A thread reads ``VmRSS`` of every process of the
API every 0.1 s (``bench.uploads.RssSampler``): idle is the mean of the 3 s before the request
(after four metadata requests of the file, so each worker has served one), the peak runs to the
last byte; their difference is the target, at most 100 MB, as for uploads (issue #48). Reported
per store: seconds to the first byte and to the last, MB/s, the API's idle and peak RSS and each
process's VmHWM, whether every line came once in input order, and the load average. The result
file records the command, the code's revision and the start and end times.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.finalization import UNIT_SIZE, output_line
from bench.provenance import STACK, Run, machine_facts
from bench.scheduler import RESULTS_DIR, WORK_DIR, log, write_report

REQUESTS = 1_000_000
PUT_THREADS = 8
READ_BYTES = 1024 * 1024  # the client's reads of the response
TARGET_MB = 100.0  # the API's RSS increase over idle while it serves the download


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/input_order.py", "bench/finalization.py")


def write_batch(rt: Any, tenant_id: str, requests: int) -> str:
    """Shards, unit results and a finalizing batch of ``requests`` lines; returns its id."""
    from storage.models import Batch, StoredFile, UnitStatus, WorkUnit, new_id
    from storage.shards import SHARD_UNITS, ShardRow, ShardWriter
    from storage.status import BatchStatus

    order = list(range(requests))
    random.Random(48).shuffle(order)  # stored (prompt) order: input line order[k] + 1 at row k
    now = int(time.time())
    batch_id = new_id("batch_")
    per_shard = UNIT_SIZE * SHARD_UNITS
    units: list[tuple[int, str, int, int, list[int]]] = []  # seq, shard, row_start, n, requests
    for s, start in enumerate(range(0, requests, per_shard)):
        key = f"batches/{batch_id}/shards/{s:05d}.parquet"
        rows = order[start : start + per_shard]
        with ShardWriter(rt.store, key, UNIT_SIZE) as writer:
            for i in rows:
                writer.add(ShardRow(i + 1, f"r{i}", "{}"))
        for r in range(0, len(rows), UNIT_SIZE):
            units.append((len(units), key, r, min(UNIT_SIZE, len(rows) - r), rows[r : r + UNIT_SIZE]))

    def put(unit: tuple[int, str, int, int, list[int]]) -> int:
        seq, _, _, _, ids = unit
        finished = list(ids)
        random.Random(seq).shuffle(finished)  # the order its requests finished in
        data = b"".join(output_line(f"r{i}", i) for i in finished)
        base = f"batches/{batch_id}/units/{seq:06d}.1"
        rt.store.put_chunks(f"{base}.output.jsonl", [data])
        rt.store.put_chunks(f"{base}.errors.jsonl", [])
        return len(data)

    with ThreadPoolExecutor(PUT_THREADS) as pool:
        written = sum(pool.map(put, units))
    log(f"input_order: {len(units)} units, {written / 1e6:.0f} MB of results written")
    with rt.db.write() as s:
        source = StoredFile(
            id=new_id("file-"), tenant_id=tenant_id, purpose="batch", filename="bench.jsonl", bytes=0,
            object_key="bench/input.jsonl", created_at=now,
        )  # fmt: skip
        s.add(source)
        s.flush()
        s.add(
            Batch(
                id=batch_id, tenant_id=tenant_id, endpoint="/v1/chat/completions", model="demo",
                input_file_id=source.id, completion_window="24h", status=BatchStatus.FINALIZING.value,
                created_at=now, expires_at=now + 86400, in_progress_at=now, finalizing_at=now,
                request_total=requests,
            )
        )  # fmt: skip
        s.flush()
        for seq, shard, row_start, n, _ in units:
            base = f"batches/{batch_id}/units/{seq:06d}.1"
            s.add(
                WorkUnit(
                    batch_id=batch_id, seq=seq, model="demo", shard_key=shard, row_start=row_start,
                    first_line=1, n_requests=n, status=UnitStatus.DONE, attempts=1, completed=n,
                    output_key=f"{base}.output.jsonl", error_key=f"{base}.errors.jsonl",
                    started_at=now, finished_at=now,
                )
            )  # fmt: skip
    return batch_id


def download(base_url: str, file_id: str, key: str, requests: int) -> dict[str, Any]:
    """GET the file in input order over HTTP, as a client would: seconds to the first and last
    byte, and whether every line came once in input order (each line's custom_id ``r<line>``)."""
    from storage.result_order import line_custom_id

    request = urllib.request.Request(
        f"{base_url}/v1/files/{file_id}/content?order=input", headers={"Authorization": f"Bearer {key}"}
    )
    t0 = time.monotonic()
    first = None
    size = lines = 0
    previous = -1
    in_order = True
    rest = b""
    with urllib.request.urlopen(request, timeout=3600) as response:
        while chunk := response.read(READ_BYTES):
            if first is None:
                first = time.monotonic() - t0
            size += len(chunk)
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            for raw in parts:
                n = int(line_custom_id(raw)[1:])
                in_order = in_order and n == previous + 1
                previous = n
                lines += 1
    seconds = time.monotonic() - t0
    return {
        "status": response.status,
        "first_byte_s": round(first or seconds, 2),
        "seconds": round(seconds, 2),
        "lines": lines,
        "output_mb": round(size / 1e6, 1),
        "mb_per_s": round(size / 1e6 / seconds, 1),
        "every_line_once_in_input_order": in_order and lines == requests and not rest,
    }


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def store_env(kind: str, root: Path, services: Any) -> tuple[dict[str, str], Any]:
    """The API's FREIGHT_* environment (a SQLite database, the local store or a SeaweedFS of its
    own), and the SeaweedFS to stop (None on the local store)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREIGHT_")}  # nothing stray
    api_port = services.free_port()
    env.update(
        {
            "FREIGHT_DATA_DIR": str(root / "data"),
            "FREIGHT_MODELS": f"demo={Path('models/demo').resolve()}",
            "FREIGHT_API_PORT": str(api_port),
            "FREIGHT_BROKER_URL": f"redis://127.0.0.1:{services.free_port(exclude=[api_port])}/0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if kind != "s3":
        return env, None
    weed = services.start_seaweedfs(root / "weed", services.free_port())
    bucket = weed.create_bucket("input-order")
    env.update(
        {
            "FREIGHT_OBJECT_STORE_URL": f"s3://{bucket}/freight",
            "FREIGHT_S3_ENDPOINT_URL": weed.endpoint_url,
            "AWS_ACCESS_KEY_ID": weed.access_key,
            "AWS_SECRET_ACCESS_KEY": weed.secret_key,
            "AWS_DEFAULT_REGION": weed.region,
        }
    )
    return env, weed


def run_store(kind: str, work: Path, requests: int) -> dict[str, Any]:
    from api.services.tenants import create_tenant
    from bench.uploads import IDLE_S, RssSampler, peaks, reset_peaks
    from infra import daemons as services
    from infra.processes import FREIGHT, Stack, wait_for
    from storage.migrate import upgrade
    from storage.models import Batch
    from storage.runtime import Runtime
    from storage.settings import Settings
    from workers.finalize import finalize_batch

    root = work / kind
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env, weed = store_env(kind, root, services)
    saved = dict(os.environ)
    stack = None
    try:
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # this process's boto3
        settings = Settings.from_env(env)
        upgrade(settings.database_url)
        rt = Runtime(settings)
        try:
            tenant, key = create_tenant(rt.db, "bench", int(time.time()))
            started = time.monotonic()
            batch_id = write_batch(rt, tenant.id, requests)
            assert finalize_batch(rt, batch_id) == "completed"
            with rt.db.read() as s:
                batch = s.get(Batch, batch_id)
                file_id = batch.output_file_id if batch is not None else None
            if not file_id:
                raise RuntimeError(f"batch {batch_id} was finalized without an output file")
            setup_s = time.monotonic() - started
        finally:
            rt.db.dispose()
        log(f"input_order [{kind}]: batch written and finalized in {setup_s:.0f} s")

        stack = Stack(root / "run", settings, env)
        stack.run_dir.mkdir(parents=True)
        proc = stack.spawn("api", [*FREIGHT, "api"])  # gunicorn, as make run starts it
        wait_for(lambda: _answers(stack.api_url + "/healthz"), "API", 60, proc, stack.log("api"))
        for _ in range(4):  # each worker's first request of a file (imports, connections) before idle
            with urllib.request.urlopen(
                urllib.request.Request(
                    f"{stack.api_url}/v1/files/{file_id}", headers={"Authorization": f"Bearer {key}"}
                ),
                timeout=60,
            ) as answer:
                answer.read()
        sampler = RssSampler({"api": proc.pid})
        sampler.start()
        time.sleep(IDLE_S)
        reset_peaks(proc.pid)
        load_before = os.getloadavg()
        t0 = time.monotonic()
        try:
            run = download(stack.api_url, file_id, key, requests)
        finally:
            t1 = time.monotonic()
            sampler.stop()
        idle = sampler.window("api", t0 - IDLE_S, t0)
        api_idle = sum(idle) / len(idle)
        api_peak = max(sampler.window("api", t0, t1))
        run.update(
            {
                "api_rss_idle_mb": round(api_idle, 1),
                "api_rss_peak_mb": round(api_peak, 1),
                "api_rss_increase_mb": round(api_peak - api_idle, 1),
                "api_processes_vmhwm_mb": peaks(proc.pid),
                "samples": len(sampler.rows),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
        log(f"input_order [{kind}]: {run}")
        return {"setup_s": round(setup_s, 1), **run}
    finally:
        if stack is not None:
            stack.stop()
        if weed is not None:
            weed.stop(timeout=0)
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--stores", default="s3", help="local, s3 or local,s3 (default s3)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "input_order.json")
    args = parser.parse_args(argv)
    prov = Run("bench.input_order", MEASURES, argv)
    work = WORK_DIR / "input_order"
    started = time.monotonic()
    try:
        stores = {kind: run_store(kind, work, args.requests) for kind in args.stores.split(",")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    increase = max(s["api_rss_increase_mb"] for s in stores.values())
    in_order = all(s["every_line_once_in_input_order"] for s in stores.values())
    report = {
        "benchmark": "a batch's output file downloaded in input order (issue #48 part 5)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_facts(),
        "provenance": prov.finish(),
        "workload": {
            "requests": args.requests,
            "unit_size": UNIT_SIZE,
            "output_line": "bench.finalization.output_line (~790 bytes); no error lines",
            "input_order": "a seeded random permutation of the stored (prompt) order",
            "server": "the API under gunicorn as make run starts it (freight api: 2 workers of 4 threads), "
            "on a SQLite database; the client reads the response in 1 MiB reads in the benchmark's process",
        },
        "stores": stores,
        # named apart from uploads.json's api_rss_increase_mb: README's table shows each key's latest file
        "targets": {
            "input_order_api_rss_increase_mb": {
                "value": increase,
                "bound": f"<= {TARGET_MB:g}",
                "pass": increase <= TARGET_MB,
            },
        },
        "every_line_once_in_input_order": in_order,
        "notes": (
            "GET /v1/files/{id}/content?order=input over HTTP from a gunicorn API process (no engine, "
            "control worker or broker: the batch is written and finalized by this benchmark before the API "
            "starts). RSS: VmRSS summed over the API's processes (gunicorn master and workers) every 0.1 s; "
            "idle is the mean of the 3 s before the request, after four metadata requests of the file "
            "(each worker's first request); the increase is the peak during the download minus idle. "
            "The sort holds 64 MB of lines and spills sorted runs to local disk beyond. The s3 store is a "
            "SeaweedFS on this machine, which has 2 cores shared with other sessions: see loadavg."
        ),
    }
    write_report(args.out, report)
    log(f"written {args.out}: api_rss_increase_mb {increase}, in order {in_order}")
    return 0 if increase <= TARGET_MB and in_order else 1


if __name__ == "__main__":
    sys.exit(main())
