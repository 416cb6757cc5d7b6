"""A 2 GB batch file uploaded in parts against the live stack (issue #48 part 1): time and memory.

    python -m bench.uploads [--gb 2] [--stores local,s3] [--quick] [--out FILE]

The issue's bound: a file of many gigabytes sent through ``/v1/uploads`` keeps the API's memory
within 100 MB of idle and validates into a batch. The whole stack runs (``bench.freight_runner``'s
``FreightStack``: Redis, the API under gunicorn, the control worker, beat, one engine worker), on
the local store and on a SeaweedFS of its own.

The input is written to disk a line at a time (never held whole): chat lines for the demo model,
each a ~3.5 KB user text (1,300-1,450 of its tokens, inside its 2,048-token context) and
``max_tokens`` 1, up to ``--gb`` GiB. The official client sends it:
``client.uploads.upload_file_chunked(file=..., mime_type="application/jsonl", purpose="batch",
part_size=64 MiB)``, timed. A sampler reads ``VmRSS`` of every process of the API (the gunicorn
master and its workers) and of the control worker (its supervisor, a process per role and their
pools) every 0.1 s, from a few seconds idle before the upload to the end. Then a batch is created
on the completed file (``completion_window`` 24h) and polled until it leaves ``validating``: it
must be ``in_progress`` (validation accepted every line). It is then cancelled: 2 GB of lines are
not run through the engine.

Reported per store: bytes, lines, parts, upload seconds and MB/s; the API's idle RSS and its peak
during the upload and during the whole run (the increase is the target, at most 100 MB); the
control worker's idle and peak RSS while it validated, and its largest process's peak (VmHWM);
validation seconds; the machine's load. ``--quick`` (0.2 GiB) checks the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.provenance import STACK, Run, machine_facts
from bench.scheduler import RESULTS_DIR, WORK_DIR, log, write_report

MIB = 1024 * 1024
GIB = 1024 * MIB
PART_SIZE = 64 * MIB  # OpenAI's largest part, the client's default
SAMPLE_S = 0.1
IDLE_S = 3.0  # sampled before the upload: the API's idle RSS
TARGET_MB = 100.0  # the API's RSS increase over idle (issue #48 part 1)
CHAT = "/v1/chat/completions"
SENTENCES = 4096  # the pool each line's text is drawn from: every text differs, cheaply
SENTENCE_WORDS = 12
LINE_SENTENCES = 46  # ~3.5 KB of text, 1,300-1,450 demo-model tokens: the context is 2,048
VALIDATION_TIMEOUT_S = 3600.0
CANCEL_TIMEOUT_S = 600.0


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/uploads.py")


def write_input(path: Path, limit: int, seed: int = 48) -> tuple[int, int]:
    """Chat lines of ~3.5 KB up to ``limit`` bytes, written as made; returns (bytes, lines)."""
    from bench.workloads import WORDS

    rng = random.Random(seed)
    pool = [" ".join(rng.choice(WORDS) for _ in range(SENTENCE_WORDS)) + "." for _ in range(SENTENCES)]
    size = lines = 0
    with path.open("wb", buffering=8 * MIB) as out:
        while True:
            text = f"Document {lines}: " + " ".join(rng.choices(pool, k=LINE_SENTENCES))
            line = {
                "custom_id": f"u{lines}",
                "method": "POST",
                "url": CHAT,
                "body": {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 1},
            }
            data = json.dumps(line).encode() + b"\n"
            if size + len(data) > limit:
                return size, lines
            out.write(data)
            size += len(data)
            lines += 1


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from the kernel's children lists."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(p for child in children for p in _tree(int(child)))]


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _title(pid: int) -> str:
    """A process's name for the report: its pid and its title (Celery's process titles name the
    role and whether it is the main or a pool process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)
    return f"{pid} {argv.strip()[:80]}"


class RssSampler(threading.Thread):
    """The summed VmRSS of each named process tree every SAMPLE_S: (time, {name: MB}) rows."""

    def __init__(self, roots: dict[str, int]) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.roots = roots
        self.rows: list[tuple[float, dict[str, float]]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            now = time.monotonic()
            self.rows.append(
                (
                    now,
                    {
                        name: sum(_status_kb(p, "VmRSS:") for p in _tree(root)) / 1024
                        for name, root in self.roots.items()
                    },
                )
            )
            self.halt.wait(max(0.0, SAMPLE_S - (time.monotonic() - now)))

    def stop(self) -> None:
        self.halt.set()
        self.join(5)

    def window(self, name: str, start: float, end: float) -> list[float]:
        return [mb[name] for t, mb in self.rows if start <= t <= end]


def reset_peaks(root: int) -> None:
    """Reset VmHWM (the peak resident set) of every process of the tree."""
    for pid in _tree(root):
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


def peaks(root: int) -> dict[str, float]:
    """VmHWM in MB of every process of the tree, by pid and title."""
    return {_title(pid): round(_status_kb(pid, "VmHWM:") / 1024, 1) for pid in _tree(root)}


def validate(client: Any, control: int, file_id: str) -> dict[str, Any]:
    """A batch on the uploaded file, polled until it leaves ``validating`` (it must be
    ``in_progress``: every line accepted), then cancelled; the control worker's peaks meanwhile."""
    reset_peaks(control)
    t_create = time.monotonic()
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    while batch.status == "validating":
        if time.monotonic() - t_create > VALIDATION_TIMEOUT_S:
            raise TimeoutError(f"batch {batch.id} still validating after {VALIDATION_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    t_validated = time.monotonic()
    control_peaks = peaks(control)
    validation_s = t_validated - t_create
    log(f"uploads: batch {batch.status} after {validation_s:.1f} s")
    if batch.status != "in_progress":
        errors = batch.errors.model_dump() if batch.errors else None
        raise RuntimeError(f"validation did not accept the file: {batch.status} {errors}")
    counts = batch.request_counts
    client.batches.cancel(batch.id)
    while batch.status not in ("cancelled", "completed", "failed", "expired"):
        if time.monotonic() - t_validated > CANCEL_TIMEOUT_S:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after the cancel")
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    return {
        "t_create": t_create,
        "t_validated": t_validated,
        "validation_s": round(validation_s, 1),
        "validated_status": "in_progress",
        "validated_requests": counts.total if counts is not None else None,
        "control_processes_vmhwm_mb": control_peaks,
        "cancel_s": round(time.monotonic() - t_validated, 1),
        "final_status": batch.status,
    }


def run_store(kind: str, work: Path, gb: float, model: Path, validating: bool = True) -> dict[str, Any]:
    from bench.cpu import OtherLoad, spent
    from bench.freight_runner import FreightStack
    from infra import daemons as services

    root = work / kind
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = root / "batch.jsonl"
    started = time.monotonic()
    size, lines = write_input(source, int(gb * GIB))
    log(
        f"uploads [{kind}]: {size / 1e9:.2f} GB, {lines:,} lines written in {time.monotonic() - started:.0f} s"
    )
    extra_env = {
        # /v1/files keeps its default limit: the file can only arrive through /v1/uploads
        "FREIGHT_MAX_FILE_BYTES": str(200 * MIB),
        "FREIGHT_MAX_REQUESTS_PER_FILE": "1000000",  # the default 50,000 holds 2 GB only in 40 KB lines
    }
    weed = None
    if kind == "s3":
        weed = services.start_seaweedfs(root / "weed", services.free_port())
        bucket = weed.create_bucket("uploads")
        extra_env.update(
            {
                "FREIGHT_OBJECT_STORE_URL": f"s3://{bucket}/freight",
                "FREIGHT_S3_ENDPOINT_URL": weed.endpoint_url,
                "AWS_ACCESS_KEY_ID": weed.access_key,
                "AWS_SECRET_ACCESS_KEY": weed.secret_key,
                "AWS_DEFAULT_REGION": weed.region,
            }
        )
    stack = FreightStack(root / "stack", model, enforce_eager=True, extra_env=extra_env)
    try:
        stack.start()
        api = int((stack.run_dir / "api.pid").read_text())
        control = int((stack.run_dir / "control.pid").read_text())
        client = stack.client("bench")
        sampler = RssSampler({"api": api, "control": control})
        sampler.start()
        time.sleep(IDLE_S)
        reset_peaks(api)
        cpu_before = stack.cpu_snapshot()
        other = OtherLoad()
        load_before = os.getloadavg()
        t_upload = time.monotonic()
        upload = client.uploads.upload_file_chunked(
            file=source, mime_type="application/jsonl", purpose="batch", part_size=PART_SIZE
        )
        t_uploaded = time.monotonic()
        if upload.status != "completed" or upload.file is None or upload.file.bytes != size:
            raise RuntimeError(f"the upload did not complete as sent: {upload}")
        upload_s = t_uploaded - t_upload
        api_peaks_upload = peaks(api)
        log(f"uploads [{kind}]: {size / 1e9:.2f} GB in {upload_s:.1f} s")

        idle = sampler.window("api", t_upload - IDLE_S, t_upload)
        api_idle = sum(idle) / len(idle)
        api_upload_peak = max(sampler.window("api", t_upload, t_uploaded))
        log(
            f"uploads [{kind}]: the API {api_idle:.1f} MB idle, {api_upload_peak - api_idle:+.1f} MB at the peak"
        )

        checked = validate(client, control, upload.file.id) if validating else None
        t_end = time.monotonic()
        sampler.stop()
        load_after = os.getloadavg()
        api_peaks_run = peaks(api)
        cpu = spent(cpu_before, stack.cpu_snapshot())
        other_cpu = other.seconds(cpu)  # the machine's CPU seconds outside the stack and this process

        api_run_peak = max(sampler.window("api", t_upload, t_end))
        control_idle = sampler.window("control", t_upload - IDLE_S, t_upload)
        if checked is not None:
            control_peak = max(sampler.window("control", checked.pop("t_create"), checked.pop("t_validated")))
            checked["control_rss_peak_validation_mb"] = round(control_peak, 1)
        result = {
            "bytes": size,
            "lines": lines,
            "line_bytes_mean": round(size / lines),
            "parts": -(-size // PART_SIZE),
            "part_size": PART_SIZE,
            "upload_s": round(upload_s, 2),
            "upload_mb_per_s": round(size / 1e6 / upload_s, 1),
            "api_rss_idle_mb": round(api_idle, 1),
            "api_rss_peak_upload_mb": round(api_upload_peak, 1),
            "api_rss_peak_run_mb": round(api_run_peak, 1),
            "api_rss_increase_upload_mb": round(api_upload_peak - api_idle, 1),
            "api_rss_increase_mb": round(api_run_peak - api_idle, 1),
            "api_processes_vmhwm_mb": {"upload": api_peaks_upload, "run": api_peaks_run},
            "control_rss_idle_mb": round(sum(control_idle) / len(control_idle), 1),
            **(checked or {"validation": "not run (--upload-only)"}),
            "samples": len(sampler.rows),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
            "cpu_s": cpu,
            "other_cpu_s": other_cpu,
            "seconds_measured": round(t_end - t_upload, 1),
        }
        log(f"uploads [{kind}]: {json.dumps(result)}")
        return result
    finally:
        stack.stop()
        if weed is not None:
            weed.stop(timeout=0)
        shutil.rmtree(root, ignore_errors=True)  # the 2 GB input, its stored copy and the shards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GiB of JSONL to upload (default 2)")
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--quick", action="store_true", help="0.2 GiB: a check of the plumbing")
    parser.add_argument(
        "--upload-only", action="store_true", help="no batch on the file: the upload's time and memory alone"
    )
    parser.add_argument("--model", type=Path, default=Path("models/demo"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    prov = Run("bench.uploads", MEASURES, argv)

    gb = 0.2 if args.quick else args.gb
    out = args.out or (WORK_DIR / "uploads-quick.json" if args.quick else RESULTS_DIR / "uploads.json")
    work = WORK_DIR / "uploads"
    started = time.monotonic()
    stores = {
        kind: run_store(kind, work, gb, args.model, not args.upload_only) for kind in args.stores.split(",")
    }
    shutil.rmtree(work, ignore_errors=True)
    increase = max(s["api_rss_increase_mb"] for s in stores.values())
    report = {
        "benchmark": "a multi-gigabyte batch file uploaded in parts against the live stack (issue #48 part 1)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "provenance": prov.finish(),
        **({"quick": True} if args.quick else {}),
        "machine": machine_facts(),
        "workload": {
            "gib": gb,
            "line": "a chat line for the demo model: one user message of ~3.5 KB of words (1,300-1,450 tokens with the chat template), max_tokens 1",
            "client": "openai client.uploads.upload_file_chunked(mime_type='application/jsonl', purpose='batch', "
            "part_size=64 MiB), no md5",
            "settings": "FREIGHT_MAX_REQUESTS_PER_FILE=1000000 (default 50,000); FREIGHT_MAX_FILE_BYTES its "
            "default 200 MiB, FREIGHT_MAX_UPLOAD_BYTES (8 GiB) and FREIGHT_MAX_LINE_BYTES (8 MiB) their defaults; "
            "gunicorn's 2 workers of 4 threads; the engine worker enforce_eager (not measured)",
        },
        "stores": stores,
        "targets": {
            "api_rss_increase_mb": {
                "value": increase,
                "bound": f"<= {TARGET_MB:g}",
                "pass": increase <= TARGET_MB,
            }
        },
        "notes": (
            "RSS: VmRSS summed over the API's processes (gunicorn master and workers) and over the "
            "control worker's (supervisor, a process per role, their pools), sampled every 0.1 s; idle "
            "is the mean of the 3 s before the upload; the increase is the peak from the upload's start "
            "to the batch's cancellation (validation polls included) minus idle, the worst store's in "
            "targets. validation_s: from batches.create to the poll that saw in_progress. The s3 store is "
            "a SeaweedFS on this machine. The machine has 2 cores shared with other sessions: see each "
            "store's loadavg and other_cpu_s (CPU seconds of processes outside the stack and this "
            "benchmark while it measured)."
        ),
    }
    write_report(out, report)
    log(f"written {out}: api_rss_increase_mb {increase}")
    return 0 if increase <= TARGET_MB else 1


if __name__ == "__main__":
    sys.exit(main())
