"""An INT4 model end to end: quantize and register it with the CLI, start its engine worker from the
registry entry, run a batch on it through the official client. On a CPU whose vLLM build has no INT4
kernel (AVX2-only x86) the worker must refuse at start with the reason instead: that is checked, and
the test then reports a skip, since the batch was not served."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest

from infra.processes import FREIGHT, REPO, _log_has, spawn, wait_for
from tests.e2e.conftest import LiveStack, wait_final
from tests.factories import chat_line, jsonl
from workers.engine import INT4_KERNEL, int4_kernel_missing

pytestmark = pytest.mark.stack


def test_an_int4_model_registered_by_the_cli_serves_a_batch(live: LiveStack, tmp_path) -> None:
    env = live.worker_env  # it starts a second engine worker
    int4 = tmp_path / "demo-w4a16"
    done = subprocess.run(
        [*FREIGHT, "models", "quantize", str(live.model_dir), str(int4), "--register", "demo-int4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote w4a16 checkpoint {int4}" in done.stdout
    assert "registered demo-int4: w4a16 from" in done.stdout
    assert "quantizing" in done.stderr  # the progress bar

    listed = [json.loads(x) for x in subprocess.run(
        [*FREIGHT, "models", "list", "--json"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()]  # fmt: skip
    assert {m["name"]: m["quantization"] for m in listed} == {"demo": "none", "demo-int4": "w4a16"}

    name = "engine-demo-int4"
    proc = spawn(
        live.stack.run_dir, name, [*FREIGHT, "worker", "--model", "demo-int4", "--name", f"{name}@%h"], env
    )
    missing = int4_kernel_missing()
    try:
        if missing is None:
            _serve_a_batch(live, proc, name)
        else:  # an AVX2-only CPU: the worker refuses at start and says why, before loading vLLM's engine
            assert proc.wait(timeout=120) != 0
            log = live.stack.log(name).read_text(errors="replace")
            assert "Error: demo-int4 (" in log and "this CPU cannot run INT4 checkpoints" in log
            assert INT4_KERNEL in log
            assert "Initializing a V1 LLM engine" not in log
    finally:  # its own process group: the engine's children go with it
        with contextlib.suppress(ProcessLookupError):  # gone already if it refused to start
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    removed = subprocess.run(
        [*FREIGHT, "models", "remove", "demo-int4"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert removed.returncode == 0 and "removed demo-int4" in removed.stdout
    if missing is not None:  # a capability this host lacks is a skip, not a pass
        pytest.skip(
            f"registered, then refused at the worker's start as it must be; serving not checked: {missing}"
        )


def _serve_a_batch(live: LiveStack, proc, name: str) -> None:
    log = live.stack.log(name)
    wait_for(lambda: _log_has(log, " ready."), "INT4 engine worker", 300, proc, log)
    assert "WNA16" in log.read_text(errors="replace")  # vLLM picked its INT4 weight-only kernel

    client = live.client("alpha")
    served = {m.id: m for m in client.models.list().data}
    assert served["demo-int4"].model_extra["x_freight"]["quantization"] == "w4a16"

    lines = [chat_line(f"q-{i}", f"count to {i}", model="demo-int4", max_tokens=8) for i in range(12)]
    upload = client.files.create(file=("int4.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    final = wait_final(client, batch.id, timeout=300)
    assert final.status == "completed", final
    assert final.request_counts.completed == 12 and final.request_counts.failed == 0
    out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"q-{i}" for i in range(12))
    assert all(r["response"]["body"]["model"] == "demo-int4" for r in out)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] > 0 for r in out)
