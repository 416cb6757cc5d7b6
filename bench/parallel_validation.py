"""Validation of one big batch across control processes: one task, chunks on one process, chunks
on two (issue #21 s1).

``python -m bench.parallel_validation [--rows 200000] [--chunk-mb 4]`` writes a chat batch of
``--rows`` lines of the million-request test's 185-byte shape, starts Redis, PostgreSQL and
SeaweedFS, and for each configuration starts the validation role of the control worker
(``freight worker --control --role validate``, one task at a time per process, as a machine's
worth) as fresh processes, submits the file and times the batch from its creation to
``in_progress`` (validation, merge, planning and the commit; the processes are warm, their
start-up is not counted). Configurations: ``one_task`` (chunking off, one process),
``chunks_1`` (chunks of ``--chunk-mb`` on one process), ``chunks_2`` (the same on two). All three
must give the same shard objects byte for byte. Each run reports its processes' peak resident
memory (``peak_rss_mb``: each control process's and its pool process's VmHWM). Results go to
``bench/results/parallel_validation.json``; with ``--rows 1000000`` (``make bench-validation``)
the best ``chunks_2`` time is issue #21's target ``validation_1m_s`` (at most 120 s with two
control processes), merged into ``bench/results/control_plane.json``. ``--shape docs`` validates
1.5 KB lines instead (bench/parquet.py's: a document behind a system prompt, and a question);
a million of them are reported in ``control_plane.json`` as ``validation_docs``, with no target.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.provenance import STACK, Run

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "bench" / "results" / "parallel_validation.json"
CONTROL_PLANE = REPO / "bench" / "results" / "control_plane.json"
TARGET_ROWS = 1_000_000
TARGET_S = 120.0  # validation + planning of a million lines on two control processes (issue #21)
CHAT = "/v1/chat/completions"


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/parallel_validation.py")


def write_input(path: Path, rows: int, shape: str = "short") -> int:
    """``short``: the million-line test's lines (tests/e2e/test_scheduler.py), 185 bytes on
    average; ``docs``: bench/parquet.py's, about 1.5 KB (a 120-word document behind a 60-word
    system prompt, and a question)."""
    if shape == "docs":
        from bench.parquet import batch_line, doc_rows

        with path.open("w") as out:
            for r in doc_rows(rows):
                out.write(json.dumps(batch_line(r)) + "\n")
        return path.stat().st_size
    with path.open("w") as out:
        for i in range(rows):
            line = {"custom_id": f"r{i}", "method": "POST", "url": CHAT,
                    "body": {"model": "demo", "messages": [{"role": "user", "content": f"Label {i % 997}: row {i}"}],
                             "max_tokens": 1}}  # fmt: skip
            out.write(json.dumps(line) + "\n")
    return path.stat().st_size


def start_processes(env: dict[str, str], n: int, run: Path, tag: str) -> list[tuple[subprocess.Popen, Path]]:
    procs = []
    for i in range(n):
        log = run / f"{tag}-{i}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.bootstrap", "worker", "--control", "--role", "validate",
                 "--name", f"{tag}{i}"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        procs.append((proc, log))
    deadline = time.monotonic() + 300
    for proc, log in procs:
        while " ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{log.name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
    return procs


def tree_pids(pid: int) -> list[int]:
    """A process and its live descendants (the role's main process, then its pool), parents first."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        pids.append(p)
        with contextlib.suppress(OSError, ValueError):
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    return pids


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants (the role's pool)."""
    total = 0.0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def tree_peak_rss_mb(pid: int) -> list[float]:
    """Peak resident memory (VmHWM, MB) of a process and of each live descendant, in that order:
    the role's main process, then its pool's process."""
    peaks = []
    for p in tree_pids(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(round(int(line.split()[1]) / 1024, 1))
    return peaks


def stop_processes(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, _ in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# a row as validation wrote it, less ``shared_tokens`` (its overlap with the row before it in its
# shard, which depends on where the shards are cut)
ROW_COLUMNS = (
    "line", "custom_id", "body", "key", "prompt_token_ids", "prompt_len", "max_tokens", "sequences", "work",
)  # fmt: skip


def rows_digest(store: Any, keys: list[str]) -> str:
    """A digest of the rows the shards hold, whatever shards hold them and in whatever order: the
    sum of each row's sha256 modulo 2**256 (a multiset hash). Two arrangements of validation agree
    when their rows do, which their shards' bytes need not (early slices cut shards elsewhere)."""
    from storage.shards import read_columns

    total = 0
    for key in keys:
        table = read_columns(store, key, ROW_COLUMNS)
        columns = [table.column(name).to_pylist() for name in table.column_names]
        for values in zip(*columns, strict=True):
            total += int.from_bytes(hashlib.sha256(repr(values).encode()).digest(), "big")
    return f"{total % (1 << 256):064x}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--model-dir", default=str(REPO / "models" / "demo"))
    parser.add_argument("--configs", default="one_task,chunks_1,chunks_2")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--shape", choices=("short", "docs"), default="short",
                        help="short: 185-byte lines (the target's); docs: 1.5 KB lines")  # fmt: skip
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    prov = Run("bench.parallel_validation", MEASURES)

    from api.services.tenants import create_tenant
    from infra import daemons
    from storage.migrate import upgrade
    from storage.models import Batch, WorkUnit
    from storage.runtime import Runtime
    from storage.settings import Settings
    from workers import intake

    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    chunk_bytes = int(args.chunk_mb * 1024 * 1024)
    with tempfile.TemporaryDirectory(dir=REPO / "var" if (REPO / "var").is_dir() else None) as tmp:
        run = Path(tmp)
        redis = daemons.start_redis(run / "redis")
        pg = daemons.start_postgres(run / "pg")
        weed = daemons.start_seaweedfs(run / "weed")
        try:
            bucket = weed.create_bucket("bench")
            aws = {
                "AWS_ACCESS_KEY_ID": "freight",
                "AWS_SECRET_ACCESS_KEY": "freight",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            os.environ.update(aws)
            db_url = pg.create_database("pvbench")
            upgrade(db_url)
            settings = Settings.from_env(
                {}, data_dir=run / "data", database_url=db_url, broker_url=redis.url_for(0),
                object_store_url=f"s3://{bucket}/freight", s3_endpoint_url=weed.endpoint_url,
                models={"demo": args.model_dir}, max_requests_per_file=10_000_000, max_file_bytes=1 << 40,
                completion_windows=("24h",), validation_chunk_bytes=chunk_bytes,
                quota_queued_requests=0, quota_open_batches=0,  # every repeat's batch stays queued
            )  # fmt: skip
            rt = Runtime(settings)
            path = run / "batch.jsonl"
            size = write_input(path, args.rows, args.shape)
            tenant, _ = create_tenant(rt.db, "bench", int(time.time()))
            with path.open("rb") as f:
                file_id = intake.upload(rt, tenant.id, "batch", "batch.jsonl", f).id
            env_base = {
                **os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "FREIGHT_DATA_DIR": str(settings.data_dir), "FREIGHT_DATABASE_URL": db_url,
                "FREIGHT_BROKER_URL": settings.broker_url, "FREIGHT_OBJECT_STORE_URL": settings.object_store_url,
                "FREIGHT_S3_ENDPOINT_URL": weed.endpoint_url, "FREIGHT_MODELS": f"demo={args.model_dir}",
                "FREIGHT_MAX_REQUESTS_PER_FILE": "10000000", "FREIGHT_MAX_FILE_BYTES": str(1 << 40),
                "FREIGHT_COMPLETION_WINDOWS": "24h", "FREIGHT_VALIDATION_CONCURRENCY": "1",
                "FREIGHT_QUOTA_QUEUED_REQUESTS": "0", "FREIGHT_QUOTA_OPEN_BATCHES": "0",
            }  # fmt: skip
            configs = {"one_task": (1, 0), "chunks_1": (1, chunk_bytes), "chunks_2": (2, chunk_bytes)}
            results: dict[str, dict] = {}
            order = [(name, r) for r in range(args.repeats) for name in args.configs.split(",")]
            for name, repeat in order:
                processes, chunking = configs[name]
                env = {**env_base, "FREIGHT_VALIDATION_CHUNK_BYTES": str(chunking)}
                procs = start_processes(env, processes, run, name)
                try:
                    cpu0 = sum(tree_cpu_seconds(p.pid) for p, _ in procs)
                    load0 = os.getloadavg()[0]
                    t0 = time.monotonic()
                    batch_id = intake.create(rt, tenant.id, {"input_file_id": file_id, "endpoint": CHAT}).id
                    while True:
                        with rt.db.read() as s:
                            batch = s.get(Batch, batch_id)
                            status, errors, total = batch.status, batch.errors, batch.request_total
                        if status != "validating":
                            break
                        time.sleep(0.1)
                    elapsed = time.monotonic() - t0
                    cpu = sum(tree_cpu_seconds(p.pid) for p, _ in procs) - cpu0
                    load1 = os.getloadavg()[0]
                    peak_rss = [tree_peak_rss_mb(p.pid) for p, _ in procs]
                finally:
                    stop_processes(procs)
                if status != "in_progress":
                    raise SystemExit(f"{name}: {status} {errors}")
                digest = hashlib.sha256()
                with rt.db.read() as s:
                    keys = list(dict.fromkeys(s.scalars(
                        WorkUnit.__table__.select().with_only_columns(WorkUnit.shard_key)
                        .where(WorkUnit.batch_id == batch_id).order_by(WorkUnit.seq))))  # fmt: skip
                for key in keys:
                    with rt.store.open(key) as stream:
                        digest.update(stream.read())
                rows = rows_digest(rt.store, keys)
                chunk_logs = [(run / f"{name}-{i}.log").read_text(errors="replace") for i in range(processes)]
                results[f"{name}#{repeat}"] = {
                    "processes": processes,
                    "chunk_bytes": chunking,
                    "requests": total,
                    "seconds": round(elapsed, 2),
                    "lines_per_s": round(args.rows / elapsed),
                    "chunk_tasks_per_process": [
                        log.count("freight.validate_chunk[") // 2 for log in chunk_logs
                    ],
                    "shards": len(keys),
                    "shards_sha256": digest.hexdigest(),
                    "rows_digest": rows,
                    "validation_cpu_s": round(cpu, 1),
                    "peak_rss_mb": peak_rss,
                    "loadavg_1min_before_after": [round(load0, 2), round(load1, 2)],
                }
                print(name, json.dumps(results[f"{name}#{repeat}"]), flush=True)
            rt.db.dispose()
        finally:
            for service in (weed, pg, redis):
                service.stop()
    digests = {r["shards_sha256"] for r in results.values()}
    row_digests = {r["rows_digest"] for r in results.values()}
    result = {
        "benchmark": "validation + planning of one batch across control processes (issue #21 s1)",
        "rows": args.rows,
        "shape": args.shape,
        "input_bytes": size,
        "shards_identical": len(digests) == 1,
        # the same rows, however the shards cut them: one task starts early slices (its first rows
        # in shards of their own, workers/head_start.py), the chunked runs do not on this file
        "rows_identical": len(row_digests) == 1,
        "runs": results,
        "best_seconds": {
            name: min(r["seconds"] for key, r in results.items() if key.split("#")[0] == name)
            for name in args.configs.split(",")
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": "2 CPU cores, shared with other sessions (see each run's load average); PostgreSQL, "
            "Redis and SeaweedFS on the same machine; each control process runs one validation task at "
            "a time; validation_cpu_s: the validation processes' CPU seconds during the run; "
            "peak_rss_mb: each control process's peak resident memory (VmHWM) and its pool "
            "process's, at the end of the run",
        },
        "started_at": started_at,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    result["provenance"] = prov.finish(
        {
            f"best_seconds.{name}": [r["seconds"] for key, r in results.items() if key.split("#")[0] == name]
            for name in result["best_seconds"]
        }
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.rows == TARGET_ROWS and result["rows_identical"]:
        from bench.dispatcher_report import merge_results, target

        section = {
            "rows": args.rows,
            "input_bytes": size,
            "best_seconds": result["best_seconds"],
            "loadavg_1min_before_after": {k: r["loadavg_1min_before_after"] for k, r in results.items()},
            "peak_rss_mb": {k: r["peak_rss_mb"] for k, r in results.items()},
            "finished_at": result["finished_at"],
            "provenance": result["provenance"],
            "details": os.path.relpath(Path(args.out).resolve(), REPO),
        }
        if args.shape == "docs":  # reported; no target
            merge_results(CONTROL_PLANE, section, {}, name="validation_docs")
        elif "chunks_2" in result["best_seconds"]:
            value = result["best_seconds"]["chunks_2"]
            merge_results(
                CONTROL_PLANE, section, {"validation_1m_s": target(value, TARGET_S, "<=")}, name="validation"
            )


if __name__ == "__main__":
    main()
