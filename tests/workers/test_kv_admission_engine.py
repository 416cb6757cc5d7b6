"""Admission by KV footprint on the real engine at tight KV (issue #51 part 6): the engine loop
(workers/engine_loop.py) drives a real vLLM engine of the demo model with a 4,096-token KV cache
(32 blocks of 128), once admitting by count alone and once by KV footprint, on the same shape of
lines: four documents of two blocks, six questions each, 400 output tokens (ignore_eos). By count
the loop hands over 16 requests and vLLM runs 8, whose outputs outgrow the cache: it preempts. By
footprint at most 7 of a document run (2 shared blocks + 4 blocks each <= 31), and vLLM never
preempts. Each run's sample is stored by the watcher's flush (workers/pack_watcher.py) and read
back from its engine_samples row: the preemptions the report and /metrics show.

Run in a fresh process: vLLM's preemptions are counted where its scheduler runs inline
(workers/engine.py: _count_preemptions), and whether this pytest process may start an inline
engine depends on what it already holds (tests/workers/test_engine.py's one-inline-engine test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

TIGHT_KV_RUN = r"""
import json, os, queue, sys, threading
from dataclasses import replace
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
from sqlalchemy import select
from storage.models import EngineSample
from scheduler.ordering import prompt_key
from storage.runtime import Runtime
from storage.settings import Settings
from storage.shards import ShardRow
from workers.cost_meter import CostMeter
from workers.engine import Engine, EngineConfig, native_half_precision
from workers.engine_loop import EngineLoop
from workers.pack_feed import PackFeed, feed_key
from workers.pack_watcher import PackWatcher
from workers.runner_state import ActiveUnit, RunnerState, new_spool
from workers.unit_claims import Claim

DOCS, QUESTIONS, DOC_TOKENS, QUESTION_TOKENS, OUTPUT = 4, 6, 256, 40, 400
# 32 blocks of 128 tokens of the demo model's 16-bit cache; in float32 (no native half precision:
# AVX2 hosts) a token's KV takes twice the bytes
KV_BYTES = 8 * 1024 * 1024 * (1 if native_half_precision() else 2)
engine = Engine.start(EngineConfig(model_path=sys.argv[1], served_name="demo", max_num_seqs=8,
                                   kv_cache_bytes=KV_BYTES, enforce_eager=True))
print("kv", json.dumps({"inline": engine.inline, "kv_blocks": engine.kv_blocks}), flush=True)


def lines(seed):
    rows = []
    for d in range(DOCS):
        doc = [(seed * 997 + d * 131 + i * 7) % 3000 + 10 for i in range(DOC_TOKENS)]
        for q in range(QUESTIONS):
            ids = doc + [(seed * 13 + d * 17 + q * 19 + i) % 3000 + 10 for i in range(QUESTION_TOKENS)]
            body = {"model": "demo", "prompt": ids, "max_tokens": OUTPUT, "ignore_eos": True, "temperature": 0}
            key = prompt_key(ids, len(ids))
            rows.append(ShardRow(line=len(rows), custom_id=f"d{d}q{q}", body_json=json.dumps(body), key=key,
                                 prompt_token_ids=ids, prompt_len=len(ids), max_tokens=OUTPUT))
    return rows


def run(admission, seed, unit_id):
    rt = Runtime(replace(Settings.from_env({}), kv_admission=admission, database_url=sys.argv[2]))
    state = RunnerState()
    finished = queue.Queue()
    feed = PackFeed(rt, state, finished, "demo", "w:1", engine.config.max_num_seqs)
    loop = EngineLoop(engine, state, feed, finished, CostMeter(3.6, 0.0), print)
    thread = threading.Thread(target=loop.run, daemon=True)
    rows = lines(seed)
    claim = Claim(unit_id, f"w:1:t{unit_id}", 1, "batch_x", "/v1/completions", "shard", unit_id, len(rows))
    unit = ActiveUnit(claim, new_spool(), new_spool(), len(rows))
    state.hold([unit])
    with state.lock:
        for row in rows:
            feed.requests.push(feed_key(unit, row), (unit, row))
    thread.start()
    done = finished.get(timeout=900)
    state.stopped.set()
    state.wake()
    thread.join(timeout=30)
    worker = f"kv-{unit_id}"
    PackWatcher(rt, state, loop, feed, worker, "demo", None, 3.6, engine.config.max_num_seqs)._flush_sample()
    with rt.db.read() as s:
        sample = s.scalars(select(EngineSample).where(EngineSample.worker == worker)).one()
    print("run", json.dumps({
        "admission": admission, "unit_done": done is unit, "completed": unit.tally.completed,
        "failed": unit.tally.failed, "preemptions": sample.preemptions, "steps": sample.steps,
        "prompt_tokens": sample.prompt_tokens, "cached_tokens": sample.cached_tokens,
        "planned_cached_tokens": sample.planned_cached_tokens, "seconds": round(sample.seconds, 2),
    }), flush=True)


run(False, 1, 1)
run(True, 2, 2)
engine.shutdown()
"""


# one database: test_pack_watcher stores the watcher's rows on both
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_admission_by_kv_footprint_ends_the_preemptions_admission_by_count_makes(
    demo_model_dir: Path, database_url: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TIGHT_KV_RUN, str(demo_model_dir), database_url],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = {}
    runs = {}
    for line in done.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag == "kv":
            said = json.loads(rest)
        elif tag == "run":
            run = json.loads(rest)
            runs[run["admission"]] = run
    assert said == {"inline": True, "kv_blocks": [31, 128]}, done.stdout[-3000:]
    by_count, by_footprint = runs[False], runs[True]
    print("by count:", by_count, "\nby KV footprint:", by_footprint)  # the figures, with -s
    for run in (by_count, by_footprint):
        assert run["unit_done"] and (run["completed"], run["failed"]) == (24, 0)
    assert by_count["preemptions"] > 0  # the shape does overflow the cache when admitted by count
    assert by_footprint["preemptions"] == 0  # counted (an inline core) and stored: 0, not NULL
    # the plan: each document's first question computes its 2 blocks, the other 5 read them
    planned = by_footprint["planned_cached_tokens"]
    assert planned == 4 * 5 * 256
    assert by_count["planned_cached_tokens"] is None  # admission by count plans nothing
    measured = by_footprint["cached_tokens"]
    gap_points = 100 * (planned - measured) / by_footprint["prompt_tokens"]
    assert gap_points <= 1.0, (measured, planned)
