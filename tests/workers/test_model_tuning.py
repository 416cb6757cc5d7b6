"""``freight models tune`` for real: a pilot on the demo model over a two-point grid writes the
registry, ``freight models list``/``show`` show it, and an engine worker started afterwards runs
with the tuned setting under the model's explicit one. Sampling a file: evenly, in bounded memory,
every skipped line named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from storage.registry import TunedSettings, record_tuning, require, tunings
from storage.runtime import Runtime
from storage.settings import Settings
from tests.conftest import REPO
from tests.factories import chat_line
from tests.workers.test_control_roles import wait_until, worker_env
from workers.model_tuning import MAX_LINE_BYTES, TuningError, engine_requests, read_sample
from workers.tuned_settings import engine_args_on_this_host

MODEL = "demo-tuned"


def test_a_sample_is_drawn_over_the_whole_file_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    good = [chat_line(f"r{i}", f"question {i}") for i in range(200)]
    with open(path, "w") as f:
        f.write("not json\n")
        f.write(json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {}}) + "\n")
        f.write(json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": "text"}) + "\n")
        f.write("x" * (MAX_LINE_BYTES + 10) + "\n")
        f.write("\n")
        for line in good:
            f.write(json.dumps(line) + "\n")
    lines, notes = read_sample(path, 20)
    assert len(lines) == 20 and all(line["url"] == "/v1/chat/completions" for line in lines)
    numbers = sorted(int(line["custom_id"][1:]) for line in lines)
    assert numbers[-1] >= 100  # drawn from the whole file, not its first lines
    assert lines == read_sample(path, 20)[0]  # seeded: the same sample every time
    assert [n.split(":")[0] for n in notes] == ["line 1", "line 2", "line 3", "line 4"]
    assert "not JSON" in notes[0] and "'/v1/embeddings'" in notes[1] and "body object" in notes[2]
    assert f"longer than {MAX_LINE_BYTES} bytes" in notes[3]
    empty = tmp_path / "none.jsonl"
    empty.write_text("not json\n")
    with pytest.raises(TuningError, match="no /v1/chat/completions or /v1/completions line"):
        read_sample(empty, 5)


def test_requests_run_in_prompt_order_as_the_served_model() -> None:
    lines = [chat_line("b", "zebra"), chat_line("a", "apple"), chat_line("c", "mango")]
    requests = engine_requests(lines, "served", salt="s")
    assert [r.body["messages"][0]["content"] for r in requests] == ["apple", "mango", "zebra"]
    assert {r.body["model"] for r in requests} == {"served"} and {r.cache_salt for r in requests} == {"s"}
    assert len({r.key for r in requests}) == 3


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_tuning_this_hosts_memory_cannot_hold_is_not_applied(
    runtime, demo_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tuning measured on a larger machine: its max_num_batched_tokens would need more memory
    than this host has (one step's activations), so the worker starts with the explicit args only."""
    entry = require(runtime.db, runtime.settings, "demo")
    fits = {"max_num_seqs": 32, "max_num_batched_tokens": 4096}
    record_tuning(runtime.db, _tuned(entry.checkpoint, fits, measured_at=1))
    assert engine_args_on_this_host(runtime.settings, runtime.db, entry, str(demo_model)) == fits
    huge = {"max_num_seqs": 32, "max_num_batched_tokens": 2**40}
    record_tuning(runtime.db, _tuned(entry.checkpoint, huge, measured_at=2, shape_class="big"))
    with caplog.at_level("WARNING", logger="workers.tuned_settings"):
        assert engine_args_on_this_host(runtime.settings, runtime.db, entry, str(demo_model)) == {}
    assert any(
        "tuned engine args of demo (big) not applied on this host" in r.message for r in caplog.records
    )


def _tuned(checkpoint: str, args: dict, measured_at: int, shape_class: str = "fits") -> TunedSettings:
    return TunedSettings(model="demo", shape_class=shape_class, checkpoint=checkpoint, engine_args=args,
                         tokens_per_second=2.0, baseline_tokens_per_second=1.0, baseline_args={}, sample="s",
                         device="cpu", points=[], notes=[], measured_at=measured_at)  # fmt: skip


def _run(env: dict[str, str], *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "api.cli", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_pilot_stores_the_faster_setting_and_the_next_worker_starts_with_it(
    settings: Settings, redis_service, demo_model: Path, tmp_path: Path
) -> None:
    """Two points: 1 sequence (the deployment's default here, measured first and again after
    the grid) and 16, on 32 short lines of 32 tokens each: 16 runs the sample in a sixteenth of the
    steps (64 against 1,024), a gap no noise of a loaded host closes (with 2 against 8 on 24 lines,
    a sub-second run each, one run of the defaults measured 4x the other under a parallel test run
    and beat 8). The model's own max_num_batched_tokens is left alone."""
    settings = replace(settings, broker_url=redis_service.url.rsplit("/", 1)[0] + "/10")
    env = worker_env(settings, VLLM_CPU_NUM_OF_RESERVED_CPU="0", FREIGHT_ENGINE_ENFORCE_EAGER="true",
                     FREIGHT_ENGINE_KV_CACHE_GIB="0.03125", FREIGHT_ENGINE_MAX_NUM_SEQS="1")  # fmt: skip
    _run(env, "models", "add", MODEL, "--path", str(demo_model), "--quantization", "none",
         "--engine-arg", "max_num_batched_tokens=2048")  # fmt: skip
    sample = tmp_path / "sample.jsonl"
    lines = [
        chat_line(f"s{i}", f"What does function {i} return?", model=MODEL, max_tokens=32) for i in range(32)
    ]
    for line in lines:
        line["body"].update(min_tokens=32, ignore_eos=True, temperature=0)
    sample.write_text("".join(json.dumps(line) + "\n" for line in lines))

    tuned_run = _run(env, "models", "tune", MODEL, "--sample", str(sample), "--requests", "32",
                     "--max-num-seqs", "1,16", "--no-speculative", "--budget", "600")  # fmt: skip

    rt = Runtime(settings)
    try:
        entry = require(rt.db, settings, MODEL)
        [tuned] = tunings(rt.db, MODEL)
    finally:
        rt.db.dispose()
    assert tuned.checkpoint == entry.checkpoint and tuned.device == "cpu"
    assert tuned.baseline_args == {"max_num_seqs": 1, "max_num_batched_tokens": 2048}
    assert [p["label"] for p in tuned.points] == ["seqs=1 tokens=2048", "seqs=16 tokens=2048"]
    assert all(p["output_tokens"] == 32 * 32 for p in tuned.points), tuned.points
    assert tuned.engine_args == {"max_num_seqs": 16}, (tuned.points, tuned.notes)
    assert tuned.tokens_per_second > 1.05 * tuned.baseline_tokens_per_second > 0
    assert tuned.shape_class.startswith("prompt-short.output-medium.")  # 32 tokens out
    assert any("max_num_batched_tokens: set on the model (2048)" in n for n in tuned.notes)
    assert any("no GPU" in n for n in tuned.notes)
    assert any("not tried (--no-speculative)" in n for n in tuned.notes)
    # the previous defaults run twice, first and after the grid, the faster of the two the baseline
    [twice] = [
        n for n in tuned.notes if n.startswith("the previous defaults ran first and again after the grid: ")
    ]
    runs = [float(x) for x in twice.split(": ", 1)[1].split(" tok/s")[0].split(" and ")]
    assert tuned.baseline_tokens_per_second == pytest.approx(max(runs), abs=0.06), twice
    assert f"{MODEL} / {tuned.shape_class}: max_num_seqs=16" in tuned_run.stdout

    listed = {
        m["name"]: m for m in map(json.loads, _run(env, "models", "list", "--json").stdout.splitlines())
    }
    assert listed[MODEL]["tuned"]["engine_args"] == {"max_num_seqs": 16}
    assert listed["demo"]["tuned"] is None
    row = next(r for r in _run(env, "models", "list").stdout.splitlines() if r.startswith(MODEL))
    # the applied class and gain, then the explicit engine arg and the tuned one it leaves in force
    assert row.split()[-3:] == [f"{tuned.shape_class}:x{tuned.gain:.2f}", "max_num_batched_tokens=2048",
                                "max_num_seqs=16(tuned)"], row  # fmt: skip
    shown = _run(env, "models", "show", MODEL).stdout
    assert "tuned (applied):" in shown and "seqs=16 tokens=2048:" in shown

    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.bootstrap", "worker", "--model", MODEL],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: " ready." in log.read_text(errors="replace"), "the engine worker", 300, proc, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    # the tuned max_num_seqs, under the model's explicit max_num_batched_tokens
    assert (
        f"engine for {MODEL} ready in " in text and "max_num_seqs=16, max_num_batched_tokens=2048" in text
    ), text[-3000:]
