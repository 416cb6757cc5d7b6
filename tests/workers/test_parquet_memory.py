"""Validating a big Parquet input holds bounded memory: peak RSS of a child process validating 5x
the rows grows by less than a fixed bound (the sort spills, shards stream a row group at a time).

The 1,000,000-row figure is in bench/results/parquet.json (``python -m bench.parquet``); here the
sizes are kept small enough for the test suite on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import DEMO_MODEL, REPO
from workers import intake

SMALL, LARGE = 12_000, 60_000
GROWTH_BOUND_MB = 60  # peak RSS of LARGE minus that of SMALL; the input itself grows by ~10 MB


def write_input(path: Path, rows: int) -> None:
    schema = pa.schema([("custom_id", pa.string()), ("prompt", pa.string()), ("max_tokens", pa.int32())])
    system = "Answer from the document. " * 8
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 10_000):
            ids = range(start, min(rows, start + 10_000))
            writer.write_table(
                pa.table(
                    {
                        "custom_id": [f"row-{i}" for i in ids],
                        "prompt": [
                            f"{system} Document {i % 97}. Question {i}: what is item {i}?" for i in ids
                        ],
                        "max_tokens": [16] * len(ids),
                    },
                    schema=schema,
                )
            )


def child(data_dir: str, input_path: str) -> None:
    """Run in a fresh process: validate one Parquet batch, print its outcome and peak RSS."""
    import io
    import resource
    import time

    from api.services.tenants import create_tenant
    from storage.migrate import upgrade
    from storage.models import Batch
    from storage.runtime import Runtime
    from storage.settings import Settings
    from workers.intake import store_file
    from workers.validation import validate_batch

    settings = Settings.from_env(
        {}, data_dir=Path(data_dir), models={"demo": str(DEMO_MODEL)}, max_requests_per_file=2_000_000,
        max_file_bytes=1 << 32, sort_memory_mb=8, unit_size=256, completion_windows=("24h",),
    )  # fmt: skip
    upgrade(settings.database_url)
    rt = Runtime(settings)
    tenant, _ = create_tenant(rt.db, "t", int(time.time()))
    with open(input_path, "rb") as f:
        record = store_file(rt, tenant.id, "batch", "big.parquet", f)
    request = intake.check_request(
        rt, {"input_file_id": "-", "endpoint": "/v1/completions", "metadata": {"default_model": "demo"}}
    )
    with rt.db.write() as s:
        s.add(record)
        s.flush()
        from dataclasses import replace

        batch_id = intake.add(s, tenant.id, replace(request, input_file_id=record.id), int(time.time())).id
    started = time.monotonic()
    validate_batch(rt, batch_id)
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        out = {"status": batch.status, "rows": batch.request_total, "errors": batch.errors}
    out["seconds"] = time.monotonic() - started
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
    _ = io


def measure(tmp: Path, rows: int) -> dict:
    path = tmp / f"in-{rows}.parquet"
    write_input(path, rows)
    code = (
        f"from tests.workers.test_parquet_memory import child; child({str(tmp / str(rows))!r}, {str(path)!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_validating_5x_the_rows_grows_peak_memory_by_less_than_the_bound(tmp_path):
    small, large = measure(tmp_path, SMALL), measure(tmp_path, LARGE)
    assert (small["status"], small["rows"]) == ("in_progress", SMALL), small
    assert (large["status"], large["rows"]) == ("in_progress", LARGE), large
    growth = large["peak_rss_mb"] - small["peak_rss_mb"]
    print(f"peak RSS {small['peak_rss_mb']:.0f} MB -> {large['peak_rss_mb']:.0f} MB ({growth:+.0f} MB)")
    assert growth < GROWTH_BOUND_MB, (small, large)
