"""A million-line output file downloaded in input order (issue #48 part 5): time and peak memory.

    python -m bench.input_order [--requests 1000000] [--stores local,s3] [--out FILE]

``GET /v1/files/{id}/content?order=input`` reads a batch's output file (prompt-sorted: the units
in seq order, each unit's lines as its requests finished), finds each line's input line from the
batch's shards, and streams the lines back in input order through an external sort
(``storage/result_order.py``: 64 MB of lines in memory, sorted runs spilled to local disk beyond).
No engine runs: the batch is written as validation and the engine workers leave it, at realistic
sizes (``bench.finalization.output_line``: ~790-byte chat completion lines, units of 256 requests,
shards of 64 units, the input lines in a seeded random order across them: the prompt sort bears
no relation to the input order, the sort's worst case), and finalized by ``finalize_batch``.

The download runs in a process of its own (spawned: nothing of the set-up in its memory) through
the Flask app in-process, the client side only counting bytes and checking the order, so its
peak RSS is the API's for this download. Reported per store: seconds to the first byte and to the
last, MB/s, the process's RSS before the request and its peak during it, and whether every line
came once in input order.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import random
import resource
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.finalization import UNIT_SIZE, output_line
from bench.scheduler import RESULTS_DIR, WORK_DIR, log, machine_facts, write_report

REQUESTS = 1_000_000
PUT_THREADS = 8


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


def measure(settings: Any, file_id: str, key: str, requests: int, answer: Any) -> None:
    """The download, in a spawned process: seconds to the first and last byte, RSS, order."""
    from api.app import create_app
    from storage.result_order import line_custom_id
    from storage.runtime import Runtime

    rt = Runtime(settings)
    client = create_app(runtime=rt).test_client()
    client.get("/healthz")  # imports and first-request set-up before the baseline
    idle_mb = _rss_now_mb()
    t0 = time.monotonic()
    response = client.get(
        f"/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {key}"},
        query_string={"order": "input"},
    )  # fmt: skip
    first = None
    size = lines = 0
    previous = -1
    in_order = response.status_code == 200
    if not in_order:
        raise RuntimeError(f"the download answered {response.status_code}: {response.get_data()[:500]!r}")
    rest = b""
    for chunk in response.response:
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
    rt.db.dispose()
    answer.put(
        {
            "status": response.status_code,
            "first_byte_s": round(first or seconds, 2),
            "seconds": round(seconds, 2),
            "lines": lines,
            "output_mb": round(size / 1e6, 1),
            "mb_per_s": round(size / 1e6 / seconds, 1),
            "every_line_once_in_input_order": in_order and lines == requests and not rest,
            "rss_before_mb": round(idle_mb, 1),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
    )


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def run_store(kind: str, work: Path, requests: int) -> dict[str, Any]:
    from api.services.tenants import create_tenant
    from infra import daemons as services
    from storage.migrate import upgrade
    from storage.models import Batch
    from storage.runtime import Runtime
    from storage.settings import Settings
    from workers.finalize import finalize_batch

    root = work / kind
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    url = f"sqlite:///{root / 'freight.db'}"
    upgrade(url)
    settings = Settings.from_env({}, data_dir=root / "data", database_url=url, models={"demo": "models/demo"})
    s3 = None
    if kind == "s3":
        s3 = services.start_seaweedfs(root / "services", services.free_port())
        bucket = s3.create_bucket("input-order")
        os.environ.update(
            AWS_ACCESS_KEY_ID="freight", AWS_SECRET_ACCESS_KEY="freight", AWS_DEFAULT_REGION="us-east-1"
        )
        settings = replace(
            settings, object_store_url=f"s3://{bucket}/freight", s3_endpoint_url=s3.endpoint_url
        )
    rt = Runtime(settings)
    try:
        tenant, key = create_tenant(rt.db, "bench", int(time.time()))
        started = time.monotonic()
        batch_id = write_batch(rt, tenant.id, requests)
        assert finalize_batch(rt, batch_id) == "completed"
        with rt.db.read() as s:
            file_id = s.get(Batch, batch_id).output_file_id
        setup_s = time.monotonic() - started
        log(f"input_order [{kind}]: batch written and finalized in {setup_s:.0f} s")
        context = multiprocessing.get_context("spawn")
        answer = context.Queue()
        child = context.Process(target=measure, args=(settings, file_id, key, requests, answer))
        child.start()
        run = None
        while run is None:  # the child's answer, or its death (an error it printed)
            try:
                run = answer.get(timeout=5)
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"the download process died (exit {child.exitcode})") from None
        child.join(60)
        run["loadavg_1min_after"] = round(os.getloadavg()[0], 2)
        log(f"input_order [{kind}]: {run}")
        return {"setup_s": round(setup_s, 1), **run}
    finally:
        rt.db.dispose()
        if s3 is not None:
            s3.stop(timeout=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "input_order.json")
    args = parser.parse_args(argv)
    work = WORK_DIR / "input_order"
    started = time.monotonic()
    stores = {kind: run_store(kind, work, args.requests) for kind in args.stores.split(",")}
    shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "a batch's output file downloaded in input order (issue #48 part 5)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_facts(),
        "workload": {
            "requests": args.requests,
            "unit_size": UNIT_SIZE,
            "output_line": "bench.finalization.output_line (~790 bytes); no error lines",
            "input_order": "a seeded random permutation of the stored (prompt) order",
        },
        "stores": stores,
        "notes": (
            "GET /v1/files/{id}/content?order=input through the Flask app in a spawned process; "
            "rss_peak_mb is that process's peak (the sort holds 64 MB of lines, the rest spills); "
            "the s3 store is a local SeaweedFS on this machine"
        ),
    }
    write_report(args.out, report)
    log(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
