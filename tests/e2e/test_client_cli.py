"""The ``freight`` client commands as a user runs them (a subprocess, talking HTTP to the live
stack): submit --wait on a real job, status, list, cancel, download, and a one-line message with
a non-zero exit, never a traceback, for every error."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra import daemons as services
from infra.processes import REPO
from tests.e2e.conftest import request_line, wait_final, write_jsonl
from tests.factories import jsonl

pytestmark = pytest.mark.stack


def freight(live, *args: str, cwd: Path, tenant: str = "alpha", **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "FREIGHT_API_URL": live.base_url, "FREIGHT_API_KEY": live.keys[tenant], **env}
    done = subprocess.run(
        [sys.executable, "-m", "api.cli", *args], cwd=cwd, env={**environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done


def error_line(done: subprocess.CompletedProcess, status: int = 1) -> str:
    """A failure is exactly one ``Error:`` line on stderr and exit status 1 (3: Freight could not
    be reached)."""
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    errors = [x for x in done.stderr.splitlines() if x.startswith("Error: ")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_submit_wait_status_list_download(live, tmp_path: Path) -> None:
    lines = [request_line(f"cli-{i}", f"Question {i} about the document") for i in range(16)]
    source = gzip.compress(jsonl(lines))  # gzip works too
    (tmp_path / "questions.jsonl.gz").write_bytes(source)
    done = freight(
        live, "submit", "questions.jsonl.gz", "--model", "demo", "--wait", "--poll", "0.5",
        "-o", "results", "-m", "project=cli", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    batch_id, *paths = done.stdout.split()
    assert batch_id.startswith("batch_") and paths == [f"results/{batch_id}.output.jsonl"]
    # progress on stderr (not a terminal here: a line per change): requests, tokens/s, ETA
    progress = [x for x in done.stderr.splitlines() if x.startswith(f"{batch_id} [")]
    assert len(progress) >= 2 and all(" requests " in x and " tok/s " in x and " ETA " in x for x in progress)
    # created validating; the first poll may already find 16 lines validated
    assert f"created {batch_id}: validating" in done.stderr
    assert progress[0].endswith(("validating", "in_progress")) and progress[-1].endswith("completed")
    assert re.search(r"\] 100% 16/16 requests  [\d,]+\.\d tok/s  ETA ", progress[-1]), progress[-1]
    assert f"{batch_id} completed after" in done.stderr and "16 completed, 0 failed" in done.stderr
    results = [json.loads(x) for x in (tmp_path / paths[0]).read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in lines)
    assert all(
        r["response"]["status_code"] == 200 and r["response"]["body"]["model"] == "demo" for r in results
    )
    batch = live.client().batches.retrieve(batch_id)
    assert batch.metadata == {"project": "cli"}

    status = freight(live, "status", batch_id, cwd=tmp_path)
    assert status.returncode == 0 and status.stdout.startswith(batch_id)
    assert "completed" in status.stdout and "16/16" in status.stdout and "SLA met" in status.stdout
    assert "cost " in status.stdout and "$" in status.stdout

    for args in (("list",), ("list", "--status", "completed", "--limit", "5"), ("status",)):
        listed = freight(live, *args, cwd=tmp_path)
        assert listed.returncode == 0 and listed.stdout.splitlines()[0].split()[:2] == ["ID", "STATUS"]
        assert batch_id in listed.stdout
    # --json: the API's own objects (a batch, a list of them), for scripts
    as_json = freight(live, "status", batch_id, "--json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    shown = json.loads(as_json.stdout)
    assert shown == live.client().batches.retrieve(batch_id).to_dict()
    listed_json = json.loads(freight(live, "list", "--json", "--limit", "5", cwd=tmp_path).stdout)
    assert listed_json["object"] == "list" and batch_id in [b["id"] for b in listed_json["data"]]
    submitted_json = freight(live, "submit", "questions.jsonl.gz", "--model", "demo", "--json", cwd=tmp_path)
    made = json.loads(submitted_json.stdout)
    assert made["object"] == "batch" and made["status"] == "validating" and made["id"] != batch_id
    assert wait_final(live.client(), made["id"], timeout=180).status == "completed"  # type: ignore[attr-defined]
    # the filter: none of this test's batches, only expired ones (other modules on the shared
    # stack, test_alerts_live, leave alpha expired batches of their own), or none at all
    expired = freight(live, "list", "--status", "expired", cwd=tmp_path)
    rows = expired.stdout.splitlines()[1:]
    assert expired.returncode == 0 and batch_id not in expired.stdout and made["id"] not in expired.stdout
    assert all(row.split()[1] == "expired" for row in rows) and (rows or "no batches" in expired.stderr)

    again = freight(live, "download", batch_id, "-o", "again", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.split() == [f"again/{batch_id}.output.jsonl"]
    assert (tmp_path / "again" / f"{batch_id}.output.jsonl").read_bytes() == (
        tmp_path / paths[0]
    ).read_bytes()

    columnar = freight(live, "download", batch_id, "-o", "pq", "--format", "parquet", cwd=tmp_path)
    assert columnar.returncode == 0 and columnar.stdout.split() == [f"pq/{batch_id}.output.parquet"]
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "pq" / f"{batch_id}.output.parquet")
    jsonl_ids = [json.loads(x)["custom_id"] for x in (tmp_path / paths[0]).read_text().splitlines()]
    assert sorted(table.column("custom_id").to_pylist()) == sorted(jsonl_ids)

    cannot = error_line(freight(live, "cancel", batch_id, cwd=tmp_path))
    assert "Cannot cancel a batch with status completed" in cannot and "409" in cannot


def test_cancel_and_a_failed_batch(live, tmp_path: Path) -> None:
    # ~256k output tokens: minutes of work on any CPU, so the batch is surely still running when
    # download and cancel arrive a few seconds later (300 x 64 tokens once finished first)
    long = [
        request_line(f"long-{i}", f"Story {i}", max_tokens=256, min_tokens=256, ignore_eos=True)
        for i in range(1000)
    ]
    submitted = freight(live, "submit", str(write_jsonl(tmp_path / "long.jsonl", long)), "--model", "demo", cwd=tmp_path)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    early = error_line(freight(live, "download", batch_id, cwd=tmp_path))
    assert "its files come when it ends" in early
    cancelled = freight(live, "cancel", batch_id, cwd=tmp_path)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{batch_id} cancelling"
    assert wait_final(live.client(), batch_id, timeout=180).status == "cancelled"  # type: ignore[attr-defined]
    status = freight(live, "status", batch_id, cwd=tmp_path)
    assert "cancelled" in status.stdout
    # another tenant's batch is as unknown as one that does not exist
    for tenant in ("beta",):
        hidden = error_line(freight(live, "status", batch_id, cwd=tmp_path, tenant=tenant))
        assert hidden == f"Error: No such Batch object: {batch_id} (HTTP 404)"

    # a file that fails validation: --wait lists the errors and exits non-zero
    dup = write_jsonl(tmp_path / "dup.jsonl", [request_line("same"), request_line("same")])
    failed = freight(live, "submit", str(dup), "--model", "demo", "--wait", "--poll", "0.5", cwd=tmp_path)
    assert "line 2: duplicate_custom_id: custom_id 'same' appears more than once" in failed.stderr
    assert error_line(failed, 4).endswith("failed") and "Error: batch batch_" in failed.stderr


def test_every_error_is_one_clear_line(live, tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "ok.jsonl", [request_line("a")])
    cases = {
        "refused the API key (401)": ("list", {"FREIGHT_API_KEY": "fk-wrong"}),
        "no API key": ("list", {"FREIGHT_API_KEY": ""}),
        f"cannot reach Freight at http://127.0.0.1:{services.free_port()}/v1": (
            "list", {"FREIGHT_API_URL": "http://127.0.0.1:{port}/v1"}
        ),
        "cannot read missing.jsonl: No such file or directory": ("submit missing.jsonl --model demo", {}),
        "not valid gzip": ("submit broken.jsonl.gz --model demo", {}),
        "No such Batch object: batch_nope (HTTP 404)": ("status batch_nope", {}),
        "completion_window must be one of": (f"submit {good} --model demo --window 3d", {}),
        "--metadata takes KEY=VALUE": (f"submit {good} --model demo -m novalue", {}),
    }  # fmt: skip
    (tmp_path / "broken.jsonl.gz").write_bytes(b"this is not gzip")
    for expected, (args, env) in cases.items():
        if "{port}" in env.get("FREIGHT_API_URL", ""):
            env = {"FREIGHT_API_URL": expected.split(" at ", 1)[1]}
        status = 3 if expected.startswith("cannot reach") else 1
        message = error_line(freight(live, *args.split(), cwd=tmp_path, **env), status)
        assert expected in message, (expected, message)
