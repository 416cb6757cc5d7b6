"""Validation and planning of a big batch: the JSON-only path against the columnar path.

``python -m bench.parquet [--rows 1000000]`` (``make bench-parquet``) writes a chat batch of
``--rows`` lines (documents shared by several questions, behind a few system prompts) as JSONL and
as its Parquet equivalent (simple shape: ``custom_id``, ``messages``, ``max_tokens``; the model as
a file default), then validates and plans it each way, each in a fresh child process, in one run:

* **json**: the JSONL input; planning re-reads every body from the store, parses it and renders
  and tokenizes its prompt again (how planning had to work without the columns);
* **columnar**: the Parquet input; planning reads only the shards' planning columns.

Validation (scan, check, render, sort, write the request store) and planning are timed apart; peak
RSS is the child's ``ru_maxrss``. Results, with the machine's CPU count and the timestamps, go to
``bench/results/parquet.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from bench.provenance import STACK, Run
from workers import intake

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "bench" / "results" / "parquet.json"
CHAT = "/v1/chat/completions"
WORDS = [
    "ledger",
    "river",
    "copper",
    "index",
    "marble",
    "signal",
    "harbor",
    "alpha",
    "beacon",
    "quarry",
    "lantern",
    "meadow",
]


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/parquet.py")


def doc_rows(rows: int, seed: int = 7) -> Iterator[dict]:
    """The requests of this benchmark, one at a time: a question about one of 2,000 documents
    (120 words) behind one of 4 system prompts (60 words); about 1.5 KB a line as JSONL.
    bench/parallel_validation.py's ``--shape docs`` uses them too."""
    rng = random.Random(seed)
    systems = [f"You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(60)) for k in range(4)]
    docs = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(2000)]
    for i in range(rows):
        d = rng.randrange(len(docs))
        messages = [
            {"role": "system", "content": systems[d % len(systems)]},
            {"role": "user", "content": f"{docs[d]}\n\nQuestion {i}: what is item {i % 50}?"},
        ]
        yield {"custom_id": f"req-{i}", "messages": messages, "max_tokens": 16}


def batch_line(request: dict) -> dict:
    """One of `doc_rows`' requests as a line of an OpenAI batch file (the model named in its body)."""
    body = {"model": "demo", "messages": request["messages"], "max_tokens": request["max_tokens"]}
    return {"custom_id": request["custom_id"], "method": "POST", "url": CHAT, "body": body}


def make_inputs(folder: Path, rows: int, seed: int = 7) -> tuple[Path, Path]:
    """The same requests as JSONL and as Parquet (written in chunks: bounded memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = folder / "batch.jsonl", folder / "batch.parquet"
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [("custom_id", pa.string()), ("messages", pa.list_(message)), ("max_tokens", pa.int32())],
        metadata={"freight.defaults": json.dumps({"model": "demo"})},
    )
    requests = doc_rows(rows, seed)
    with jsonl.open("w") as out, pq.ParquetWriter(parquet, schema, compression="zstd") as writer:
        while chunk := list(itertools.islice(requests, 50_000)):
            for r in chunk:
                out.write(json.dumps(batch_line(r)) + "\n")
            writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
    return jsonl, parquet


def child(mode: str, data_dir: str, input_path: str, model_dir: str) -> None:
    """In a fresh process: validate and plan one batch; print timings and peak RSS as JSON."""
    from dataclasses import replace

    from api.services.tenants import create_tenant
    from storage.migrate import upgrade
    from storage.runtime import Runtime
    from storage.settings import Settings
    from workers.intake import store_file
    from workers.planning import plan_batch
    from workers.prompt_tokens import renderer_for
    from workers.validation import FileRules, PromptRenders, write_store

    settings = Settings.from_env(
        {}, data_dir=Path(data_dir), models={"demo": model_dir}, max_requests_per_file=10_000_000,
        max_file_bytes=1 << 40, completion_windows=("24h",),
        validation_head_rows=0,  # a file this size is validated in chunks, which start no slices
    )  # fmt: skip
    upgrade(settings.database_url)
    rt = Runtime(settings)
    tenant, _ = create_tenant(rt.db, "bench", int(time.time()))
    with open(input_path, "rb") as f:
        record = store_file(rt, tenant.id, "batch", Path(input_path).name, f)
    request = intake.check_request(rt, {"input_file_id": "-", "endpoint": CHAT})
    with rt.db.write() as s:
        s.add(record)
        s.flush()
        batch_id = intake.add(s, tenant.id, replace(request, input_file_id=record.id), int(time.time())).id
    renders = PromptRenders(rt)
    rules = FileRules(CHAT, frozenset(settings.models), settings.max_requests_per_file,
                      settings.max_line_bytes, renders.one, renders.many)  # fmt: skip
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.monotonic()
    summary, shard_keys, _ = write_store(rt, batch_id, record.object_key, rules, {})
    validated = time.monotonic()
    rss_validation = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reparse = (CHAT, renderer_for(model_dir, settings.sort_key_tokens)) if mode == "json" else None
    units = plan_batch(rt.store, shard_keys, settings, reparse=reparse)
    planned = time.monotonic()
    print(
        json.dumps(
            {
                "mode": mode,
                "rows": summary.rows,
                "errors": summary.error_count,
                "shards": len(shard_keys),
                "units": len(units),
                "validation_s": round(validated - started, 2),
                "planning_s": round(planned - validated, 3),
                "total_s": round(planned - started, 2),
                "peak_rss_mb_before": round(rss_before, 1),
                "peak_rss_mb_validation": round(rss_validation, 1),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )


def run_child(mode: str, work: Path, input_path: Path, model_dir: str) -> dict:
    code = f"from bench.parquet import child; child({mode!r}, {str(work / mode)!r}, {str(input_path)!r}, {model_dir!r})"
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--model-dir", default=str(REPO / "models" / "demo"))
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    prov = Run("bench.parquet", MEASURES)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(dir=REPO / "var" if (REPO / "var").is_dir() else None) as tmp:
        work = Path(tmp)
        t = time.monotonic()
        jsonl, parquet = make_inputs(work, args.rows)
        generated = time.monotonic() - t
        runs = {
            "json": run_child("json", work, jsonl, args.model_dir),
            "columnar": run_child("columnar", work, parquet, args.model_dir),
        }
        sizes = {"jsonl_bytes": jsonl.stat().st_size, "parquet_bytes": parquet.stat().st_size}
    j, c = runs["json"], runs["columnar"]
    result = {
        "benchmark": "validation + planning of one batch: JSON-only path vs columnar path",
        "rows": args.rows,
        "inputs": {**sizes, "generated_s": round(generated, 1)},
        "runs": runs,
        "ratios_json_over_columnar": {
            "planning_time": round(j["planning_s"] / max(c["planning_s"], 1e-9), 1),
            "validation_time": round(j["validation_s"] / max(c["validation_s"], 1e-9), 2),
            "total_time": round(j["total_s"] / max(c["total_s"], 1e-9), 2),
            "peak_rss": round(j["peak_rss_mb"] / max(c["peak_rss_mb"], 1e-9), 2),
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "note": "2 CPU cores shared with other sessions running tests; one run of each path, "
            "back to back in the same invocation",
        },
        "started_at": started_at,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "provenance": prov.finish(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
