"""A model's engine arguments on the live stack: registered with settings this machine cannot
honour (vLLM-CPU binds each tensor-parallel rank to a NUMA node, and this machine has one), its
worker refuses to start with the model and vLLM's reason, and the batch already queued
for it waits (nothing failed, nothing claimed); with the setting unset the next worker starts with
the model's other arguments in force and runs that batch to the end, every line once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import select

from infra.processes import FREIGHT, REPO, _log_has, spawn, wait_for
from storage.db import Database
from storage.models import WorkUnit
from storage.status import UnitStatus
from tests.e2e.conftest import LiveStack, wait_final
from tests.factories import chat_line, jsonl

pytestmark = pytest.mark.stack

MODEL = "demo-engine-args"
# what vLLM-CPU refuses at start on a one-NUMA-node machine (it binds each tensor-parallel rank to
# a node); the registry accepts it: a GPU host, or a two-node CPU host, would honour it
UNHONOURED = "tensor_parallel_size=2"
REFUSAL = "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"


def _freight(live: LiveStack, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=live.stack.env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def _units(live: LiveStack, batch_id: str) -> list[WorkUnit]:
    db = Database(live.stack.settings.database_url)
    try:
        with db.read() as s:
            return list(s.scalars(select(WorkUnit).where(WorkUnit.batch_id == batch_id)))
    finally:
        db.dispose()


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # its own process group: the engine's go with it
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=90)


@pytest.mark.skipif(
    len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) > 1,
    reason="vLLM-CPU runs tensor_parallel_size=2 on two NUMA nodes",
)
def test_an_unhonoured_engine_arg_fails_the_worker_and_keeps_the_batch(live: LiveStack) -> None:
    added = _freight(live, "models", "add", MODEL, "--path", str(live.model_dir), "--quantization", "none",
                     "--engine-arg", UNHONOURED, "--engine-arg", "max_num_seqs=4",
                     "--engine-arg", "max_num_batched_tokens=1024")  # fmt: skip
    assert added.returncode == 0, added.stderr[-2000:]
    try:
        _run(live)
    finally:
        removed = _freight(live, "models", "remove", MODEL)
        assert removed.returncode == 0, removed.stderr


def _run(live: LiveStack) -> None:
    client = live.client("alpha")
    lines = [chat_line(f"e-{i}", f"count to {i}", model=MODEL, max_tokens=6) for i in range(20)]
    upload = client.files.create(file=("engine-args.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    wait_final(client, batch.id, timeout=120, until=("in_progress", "failed"))

    name = "engine-args-worker"
    log = live.stack.log(name)
    # the engine core in a process of its own (the GPU default), where vLLM logs the reason there
    # only; inline (this CPU's default, started below) vLLM raises it in the worker itself
    separate = {**live.worker_env, "FREIGHT_ENGINE_CORE": "process"}
    proc = spawn(live.stack.run_dir, name, [*FREIGHT, "worker", "--model", MODEL, "--name", f"{name}@%h"],
                 separate)  # fmt: skip
    try:
        code = proc.wait(timeout=300)
    finally:
        _stop(proc)
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("Error: ")]
    assert code == 1 and errors, text[-3000:]
    assert errors[-1].startswith(f"Error: model '{MODEL}': vLLM could not start its engine with engine args ")
    assert UNHONOURED in errors[-1] and REFUSAL in errors[-1], errors[-1]
    # vLLM logs the reason in its engine process only; the worker's one line carries it
    # (workers/engine_lifetime.py), on one line
    assert errors[-1].endswith("(in vLLM's engine process)"), errors[-1]

    # nothing of the batch was claimed, failed or lost by the failed start (which spanned dozens
    # of dispatcher ticks: FREIGHT_TICK_SECONDS=1 on the live stack)
    after = client.batches.retrieve(batch.id)
    assert after.status == "in_progress", after
    assert after.request_counts.completed == 0 and after.request_counts.failed == 0
    units = _units(live, batch.id)
    assert units and all(u.status in (UnitStatus.PENDING, UnitStatus.QUEUED) for u in units)
    assert all(u.attempts == 0 and u.worker is None for u in units), [(u.status, u.attempts) for u in units]

    fixed = _freight(live, "models", "set-engine", MODEL, "--unset", "tensor_parallel_size")
    assert fixed.returncode == 0 and "max_num_batched_tokens=1024 max_num_seqs=4" in fixed.stdout, fixed
    listed = {
        m["name"]: m for m in map(json.loads, _freight(live, "models", "list", "--json").stdout.splitlines())
    }
    assert listed[MODEL]["engine_args"] == {"max_num_seqs": 4, "max_num_batched_tokens": 1024}

    offset = log.stat().st_size
    proc = spawn(live.stack.run_dir, name, [*FREIGHT, "worker", "--model", MODEL, "--name", f"{name}@%h"],
                 live.worker_env)  # fmt: skip
    try:
        wait_for(lambda: _log_has(log, " ready.", offset), "engine-args worker", 300, proc, log)
        with open(log, "rb") as f:
            f.seek(offset)
            started = f.read().decode(errors="replace")
        # the engine's own config, as the worker logged it once ready
        assert f"engine for {MODEL} ready" in started
        assert "max_num_seqs=4, max_num_batched_tokens=1024" in started
        final = wait_final(client, batch.id, timeout=300)
    finally:
        _stop(proc)
    assert final.status == "completed", final
    assert final.request_counts.completed == len(lines) and final.request_counts.failed == 0
    out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in lines)
    assert all(r["response"]["body"]["model"] == MODEL for r in out)
