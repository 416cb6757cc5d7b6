"""System (c): Freight end to end, through its OpenAI-compatible Batch API, on a warm stack.

    python -m bench.freight_runner --out RESULT.json [engine flags] FILE [FILE ...]
    python -m bench.freight_runner --out RESULT.json --multi-job FILE      # 20 batches, 3 tenants

`FreightStack` starts the whole local stack (`infra.processes.up`: Redis, API, control worker, one
engine worker, beat) with the given engine limits, makes the tenants with `freight tenant create`,
and runs a small warm-up batch (and `warmup_file`, a file of the measured shape, if given), so
every measured run finds the engine loaded and compiled for its batch shapes.

A run (`run_jobs`): the clock starts, every file is uploaded with the official `openai` client
(`files.create(purpose="batch")`) and its batch created (`batches.create`), the jobs concurrently
from SUBMIT_THREADS threads ("submitted together", as independent teams would); the batches are polled (one
`batches.list` per tenant every SLOW_POLL_S, every POLL_INTERVAL_S near the end) until every one is
terminal with its output file; the clock stops at that poll. Between polls the client naps on a
webhook receiver (`bench/batch_events.py`, registered for every tenant with `freight webhooks
add`): Freight's `batch.completed` event wakes it for the poll at once, as a team's service
hears of its job's end. Then the output and error files are read and every custom_id
must come back exactly once across them.

Measured per run:
  wall_s          first upload to the poll that saw the last batch terminal with its output file
  tokens          summed from the batch objects' `usage` (input_tokens,
                  input_tokens_details.cached_tokens, output_tokens)
  batch_fill      from the engine worker's `engine_samples` rows overlapping the run's window,
                  each weighted by its overlap: sum(running_mean * overlap) / sum(max_num_seqs *
                  overlap); null where the table does not exist (older Freight) or has no rows
  engine_steps    the engine's steps over the same rows, each period's share by its overlap: beside
                  the in-process engine's ``steps``, whether a slower run took more steps
  kv_report       KV-aware admission's figures of the same rows, whole (`engine_samples_kv`):
                  vLLM's preemptions and the hit-rate gap to the plan in points (targets 0 and <= 1)
  phases_s        wall_s split at the work units' timestamps (`run_phases`): to the first unit
                  queued, to the first one started, the engine phase, finalization and the last poll
  errors          error-file lines + missing custom_ids + duplicated custom_ids + batches that did
                  not complete
  cpu_s           CPU seconds per stack process over the run (bench/cpu.py): api, control, beat,
                  each engine worker's front end and (``/children``) its vLLM processes, redis
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.batch_events import BatchEvents
from infra.processes import FREIGHT, create_tenant

REPO = Path(__file__).resolve().parent.parent
SUBMIT_THREADS = 8
POLL_INTERVAL_S = 0.25
SLOW_POLL_S = 1.0  # until NEAR_END of the requests are done
NEAR_END = 0.8  # of the open batches' requests done: poll often from there on (or sooner, by rate)
RUN_TIMEOUT_S = 3600.0
WARMUP_REQUESTS = 16
NO_TABLE = -1.0  # engine_samples_fill's "covered" when the table does not exist
TERMINAL = ("completed", "failed", "expired", "cancelled")


# the sizes every committed result ran at, Freight's defaults before they followed the device
# (scheduler/engine_defaults.py): a 1 GiB KV cache unless one is given, vLLM's LLMEngine token budget
PREVIOUS_KV_BYTES = 1024**3
PREVIOUS_BATCHED_TOKENS = 2048


def kv_gib(kv_bytes: int) -> str:
    """FREIGHT_ENGINE_KV_CACHE_GIB for exactly `kv_bytes` (Freight computes int(gib * 1024**3))."""
    return repr((kv_bytes + 0.5) / 1024**3)


@dataclass
class FreightStack:
    run_dir: Path
    model_dir: Path
    max_num_seqs: int = 64
    kv_cache_bytes: int | None = None  # None: Freight's previous default, PREVIOUS_KV_BYTES
    max_model_len: int | None = None
    enforce_eager: bool = False
    block_size: int | None = None  # None: Freight's default FREIGHT_ENGINE_BLOCK_SIZE
    tenants: tuple[str, ...] = ("bench",)
    warmup_file: Path | None = None  # run once, unmeasured, after the small warm-up batch
    endpoint: str = "/v1/chat/completions"  # every batch's (the model's task must serve it)
    extra_env: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    stack: Any = None
    startup_s: float | None = None
    code_dir: Path = REPO  # the checkout whose code the stack's processes run (an A/B's baseline)
    batch_events: bool = True  # a webhook receiver wakes the client's poll (bench/batch_events.py)
    events: BatchEvents | None = None

    def freight_env(self) -> dict[str, str]:
        from infra import daemons as services

        broker_port = services.free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FREIGHT_")}  # nothing stray
        env.update(
            {
                "FREIGHT_DATA_DIR": str(self.run_dir / "data"),
                "FREIGHT_MODELS": f"demo={self.model_dir.resolve()}",
                "FREIGHT_BROKER_URL": f"redis://127.0.0.1:{broker_port}/0",
                "FREIGHT_API_PORT": str(services.free_port(exclude=[broker_port])),
                "FREIGHT_ENGINE_MAX_NUM_SEQS": str(self.max_num_seqs),
                "FREIGHT_ENGINE_MAX_NUM_BATCHED_TOKENS": str(PREVIOUS_BATCHED_TOKENS),
                "FREIGHT_ENGINE_KV_CACHE_GIB": kv_gib(self.kv_cache_bytes or PREVIOUS_KV_BYTES),
                "FREIGHT_ENGINE_ENFORCE_EAGER": "true" if self.enforce_eager else "false",
                "FREIGHT_MAX_REQUESTS_PER_FILE": "1000000",
                "FREIGHT_MAX_FILE_BYTES": str(2 * 1024**3),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_NO_USAGE_STATS": "1",
            }
        )
        if self.batch_events:  # the receiver listens on 127.0.0.1
            env["FREIGHT_WEBHOOK_ALLOW_PRIVATE_TARGETS"] = "true"
        if self.max_model_len:
            env["FREIGHT_ENGINE_MAX_MODEL_LEN"] = str(self.max_model_len)
        if self.block_size:
            env["FREIGHT_ENGINE_BLOCK_SIZE"] = str(self.block_size)
        env.update(self.extra_env)
        return env

    def start(self) -> FreightStack:
        from infra.processes import up

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = self.freight_env()
        started = time.monotonic()
        self.stack = up(self.run_dir, self.env, code_dir=self.code_dir)
        try:
            self.startup_s = time.monotonic() - started
            for name in self.tenants:
                self.keys[name] = create_tenant(self.env, name)
            if self.batch_events:
                self.events = BatchEvents()
                for name in self.tenants:  # as an operator would, through the CLI
                    subprocess.run(
                        [*FREIGHT, "webhooks", "add", self.events.url, "--tenant", name],
                        cwd=REPO,
                        env=self.env,
                        capture_output=True,
                        check=True,
                    )
            self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.stack is not None:
            self.resume()
            self.stack.stop()
            self.stack = None
        if self.events is not None:
            self.events.close()
            self.events = None

    def __enter__(self) -> FreightStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return self.stack.api_url + "/v1"

    def client(self, tenant: str) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key=self.keys[tenant], max_retries=3, timeout=600)

    def settings(self) -> dict[str, Any]:
        s = self.stack.settings
        return {
            "max_num_seqs": s.engine_max_num_seqs,
            "kv_cache_gib": s.engine_kv_cache_gib,
            "kv_cache_bytes": int(s.engine_kv_cache_gib * 1024**3),
            "max_model_len": s.engine_max_model_len or None,
            "enforce_eager": s.engine_enforce_eager,
            "engine_core": getattr(s, "engine_core", None),  # None: a Freight without the setting
            "max_num_batched_tokens": s.engine_max_num_batched_tokens,
            "unit_size": s.unit_size,
            "queue_depth": s.queue_depth,
            "tick_seconds": s.tick_seconds,
            "prefix_cache_sharing": getattr(s, "prefix_cache_sharing", None),  # None: a Freight without it
            "batch_events": self.batch_events,  # the client's poll woken by Freight's webhook events
            "startup_s": self.startup_s,
            "env": {
                k: v
                for k, v in self.env.items()
                if k.startswith(("FREIGHT_ENGINE_", "FREIGHT_UNIT", "FREIGHT_PREFIX_CACHE", "VLLM_CPU"))
            },
        }

    def warm_up(self) -> None:
        """A small batch through the whole path: engine compiled, every process past its first request."""
        chat = {"max_tokens": 8, "min_tokens": 8, "ignore_eos": True, "temperature": 0}
        lines = [
            {
                "custom_id": f"warm-{i}",
                "method": "POST",
                "url": self.endpoint,
                "body": {"model": "demo", "input": f"warm up input {i}"}
                if self.endpoint == "/v1/embeddings"
                else {
                    "model": "demo",
                    "messages": [{"role": "user", "content": f"warm up request {i}"}],
                    **chat,
                },
            }
            for i in range(WARMUP_REQUESTS)
        ]
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        result = self.run_jobs([(self.tenants[0], ("warmup.jsonl", data))], timeout=600)
        if result["errors"]:
            raise RuntimeError(f"warm-up batch failed: {result}")
        if self.warmup_file is not None:
            result = self.run_jobs([(self.tenants[0], self.warmup_file)], timeout=1800)
            if result["errors"]:
                raise RuntimeError(f"warm-up file failed: {result}")

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.stack.processes.values()]

    def cpu_roles(self) -> dict[str, int]:
        """Each stack process by name (engine workers with their vLLM processes), and Redis."""
        from infra.daemons import read_pidfile

        roles = {name: proc.pid for name, proc in self.stack.processes.items()}
        redis = read_pidfile(self.run_dir / "redis.pid")
        if redis:
            roles["redis"] = redis[0]
        return roles

    def cpu_snapshot(self) -> dict[str, float]:
        from bench.cpu import snapshot

        engines = tuple(name for name in self.stack.processes if name.startswith("engine-"))
        return snapshot(self.cpu_roles(), split=engines)

    def control_snapshot(self) -> dict[str, float]:
        from bench.cpu import control_roles

        pid = self.cpu_roles().get("control")
        return control_roles(pid) if pid else {}

    def pause(self) -> None:
        """Stop every process of the idle stack (bench/freeze.py); Redis keeps running."""
        from bench.freeze import pause

        pause(self.pids())

    def resume(self) -> None:
        from bench.freeze import resume

        resume(self.pids())

    def run_jobs(
        self, jobs: list[tuple[str, Path | tuple[str, bytes]]], timeout: float = RUN_TIMEOUT_S
    ) -> dict[str, Any]:
        """Submit every (tenant, file) together; wait for all; measure and check (see module doc)."""
        expected: list[str] = []
        payloads: list[tuple[str, str, bytes]] = []
        for tenant, source in jobs:
            if isinstance(source, tuple):
                name, data = source
            else:
                name, data = source.name, source.read_bytes()
            expected += [json.loads(x)["custom_id"] for x in data.decode("utf-8").splitlines() if x.strip()]
            payloads.append((tenant, name, data))
        clients = {tenant: self.client(tenant) for tenant in {t for t, _ in jobs}}

        from bench.cpu import OtherLoad

        cpu_before = self.cpu_snapshot()
        roles_before = self.control_snapshot()
        other = OtherLoad()
        wall_start = time.time()
        started = time.monotonic()

        def submit(job: tuple[str, str, bytes]) -> tuple[str, str]:
            tenant, name, data = job
            client = self.client(tenant)  # one client per thread
            file_id = client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id
            batch = client.batches.create(
                input_file_id=file_id, endpoint=self.endpoint, completion_window="24h"
            )
            return batch.id, tenant

        # the jobs arrive together, as from independent teams: each uploads and creates at once
        with ThreadPoolExecutor(max_workers=min(len(payloads), SUBMIT_THREADS)) as pool:
            batch_ids: dict[str, str] = dict(pool.map(submit, payloads))  # batch id -> tenant
        submitted_s = time.monotonic() - started

        final: dict[str, Any] = {}
        woken = False  # whether the poll that saw the end was woken by a batch event
        first_seen: tuple[float, int] | None = None  # (when, requests done) at the first progress seen
        while True:
            progress = [0, 0]  # requests done, requests in all listed batches
            for tenant, client in clients.items():
                open_ids = {b for b, t in batch_ids.items() if t == tenant and b not in final}
                if not open_ids:
                    continue  # like a team whose jobs are all done: it stops asking
                for batch in _list_batches(client, open_ids):
                    counts = batch.request_counts
                    if counts is not None:
                        progress[0] += counts.completed + counts.failed
                        progress[1] += counts.total
                    done = batch.status in TERMINAL and (
                        batch.output_file_id or batch.error_file_id or batch.status == "failed"
                    )
                    if done:
                        final[batch.id] = batch
            if len(final) == len(batch_ids):
                break
            if time.monotonic() - started > timeout:
                raise TimeoutError(
                    f"{len(batch_ids) - len(final)} of {len(batch_ids)} batches not terminal after {timeout:.0f}s"
                )
            # poll slowly until the end is near, then often: the end is timed to POLL_INTERVAL_S
            # without the API answering 4 polls a second per tenant for the whole run. Near: most
            # requests done, or the rate so far says the rest take less than two slow polls (counts
            # move as units end, so a run of few units can jump from under NEAR_END to its end)
            done = progress[0] + sum(b.request_counts.total for b in final.values() if b.request_counts)
            now = time.monotonic()
            if first_seen is None and done:
                first_seen = (now, done)
            near = bool(progress[1]) and progress[0] >= NEAR_END * progress[1]
            if first_seen is not None and done > first_seen[1] and progress[1]:
                rate = (done - first_seen[1]) / max(now - first_seen[0], 1e-3)  # requests a second
                near = near or (progress[1] - progress[0]) / rate < 2 * SLOW_POLL_S
            woken = self.nap(POLL_INTERVAL_S if near else SLOW_POLL_S)
        wall = time.monotonic() - started
        wall_end = time.time()
        from bench.cpu import spent

        cpu = spent(cpu_before, self.cpu_snapshot())
        control_roles = spent(roles_before, self.control_snapshot())
        other_cpu = other.seconds(cpu)

        seen: dict[str, int] = {}
        error_lines = 0
        for batch_id, batch in final.items():
            client = clients[batch_ids[batch_id]]
            for file_id, is_error in ((batch.output_file_id, False), (batch.error_file_id, True)):
                if not file_id:
                    continue
                for raw in client.files.content(file_id).text.splitlines():
                    if not raw.strip():
                        continue
                    line = json.loads(raw)
                    seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + 1
                    response = line.get("response") or {}
                    if is_error or line.get("error") or response.get("status_code") != 200:
                        error_lines += 1
        missing = sum(1 for cid in expected if cid not in seen)
        duplicated = sum(n - 1 for n in seen.values() if n > 1)
        not_completed = [b.status for b in final.values() if b.status != "completed"]

        def usage(batch: Any, *path: str) -> int:
            value: Any = batch.usage
            for key in path:
                value = getattr(value, key, None) if not isinstance(value, dict) else value.get(key)
            return int(value or 0)

        return {
            "wall_s": wall,
            "submit_s": submitted_s,
            "end_seen_on_event": woken,
            "requests": len(expected),
            "batches": len(batch_ids),
            "tenants": len(clients),
            "prompt_tokens": sum(usage(b, "input_tokens") for b in final.values()),
            "cached_tokens": sum(usage(b, "input_tokens_details", "cached_tokens") for b in final.values()),
            "output_tokens": sum(usage(b, "output_tokens") for b in final.values()),
            "errors": error_lines + missing + duplicated + len(not_completed),
            "error_lines": error_lines,
            "missing": missing,
            "duplicated": duplicated,
            "not_completed": not_completed,
            **self.fill(wall_start, wall_end),
            "kv_report": engine_samples_kv(self.stack.settings.database_url, wall_start, wall_end),
            "phases_s": run_phases(self.stack.settings.database_url, list(batch_ids), wall_start, wall_end),
            "batch_fill_method": "engine_samples rows overlapping the run's window: "
            "sum(running_mean*overlap) / sum(max_num_seqs*overlap)",
            "window": [wall_start, wall_end],
            "batch_ids": list(batch_ids),
            "cpu_s": cpu,
            "other_cpu_s": other_cpu,
            "control_roles_cpu_s": control_roles,  # cpu_s's control, by role (bench/cpu.py)
        }

    def nap(self, seconds: float) -> bool:
        """The client's sleep between polls: cut short by a batch event when the stack sends them."""
        if self.events is None:
            time.sleep(seconds)
            return False
        return self.events.nap(seconds)

    def fill(self, start: float, end: float) -> dict[str, Any]:
        """Batch fill over [start, end] from the worker's engine_samples (null without rows).

        The worker writes a row per sample period (FREIGHT_SAMPLE_SECONDS) at its end, so this waits
        (off the clock) up to one period for the row that covers the window's end.
        """
        url = self.stack.settings.database_url
        period = float(getattr(self.stack.settings, "sample_seconds", 5.0))
        deadline = time.monotonic() + period + 1.5
        while True:
            fill, covered, steps = engine_samples_fill(url, start, end)
            if covered == NO_TABLE:
                return {"batch_fill": None, "fill_seconds_covered": None, "engine_steps": None}
            if covered >= 0.95 * (end - start) or time.monotonic() > deadline:
                return {"batch_fill": fill, "fill_seconds_covered": round(covered, 2), "engine_steps": steps}
            time.sleep(0.5)


def engine_samples_fill(
    database_url: str, start: float, end: float
) -> tuple[float | None, float, float | None]:
    """(fill, seconds of samples seen, engine steps) over [start, end] from engine_samples;
    (None, 0, None) without rows, (None, NO_TABLE, None) without the table.

    A row's busy seconds run from its first step (``started_at``, workers/engine_loop.py) for
    ``seconds``; each counts by that span's overlap with the window, so a run shorter than the
    sample period is still measured: sum(running_mean * overlap) / sum(max_num_seqs * overlap).
    Steps are shared out the same way (a period's steps times the part of its span inside the
    window): the count to set beside the in-process engine's ``steps``, where a run at the same
    cache-hit rate is slower. (Rows written before that placed the span at the period's start,
    idle time included: a run's first period then counted too few steps.)
    """
    import sqlalchemy as sa

    engine = sa.create_engine(database_url)
    try:
        if not sa.inspect(engine).has_table("engine_samples"):
            return None, NO_TABLE, None
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT started_at, seconds, running_mean, max_num_seqs, steps FROM engine_samples "
                    "WHERE started_at <= :end AND started_at + seconds >= :start"
                ),
                {"start": start, "end": end},
            ).all()
    except sa.exc.SQLAlchemyError:
        return None, 0.0, None
    finally:
        engine.dispose()
    running = capacity = covered = steps = 0.0
    for started_at, seconds, running_mean, max_num_seqs, period_steps in rows:
        overlap = max(0.0, min(end, started_at + seconds) - max(start, started_at))
        running += float(running_mean) * overlap
        capacity += float(max_num_seqs) * overlap
        covered += overlap
        steps += float(period_steps) * (overlap / float(seconds) if seconds else 1.0)
    return (running / capacity if capacity else None), covered, (round(steps, 1) if rows else None)


def engine_samples_kv(database_url: str, start: float, end: float) -> dict[str, Any] | None:
    """KV-aware admission's report over the engine_samples rows overlapping [start, end], each
    whole (a period's counts are of events, not shared out): vLLM's preemptions (None where no row
    counted them: a core in its own process), and the prefix-cache hits the plan gave the finished
    requests against those measured, as a share of their prompt tokens, and the gap in points
    (None where no row had a plan: FREIGHT_KV_ADMISSION off). None without the columns or rows."""
    import sqlalchemy as sa

    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT count(*), sum(preemptions), sum(planned_cached_tokens), "
                    "sum(CASE WHEN planned_cached_tokens IS NULL THEN 0 ELSE cached_tokens END), "
                    "sum(CASE WHEN planned_cached_tokens IS NULL THEN 0 ELSE prompt_tokens END) "
                    "FROM engine_samples WHERE started_at <= :end AND started_at + seconds >= :start"
                ),
                {"start": start, "end": end},
            ).one()
    except sa.exc.SQLAlchemyError:
        return None  # an older Freight: no table or no columns
    finally:
        engine.dispose()
    rows, preemptions, planned, cached, prompt = row
    if not rows:
        return None
    planned_pct = measured_pct = gap = None
    if planned is not None and prompt:
        planned_pct, measured_pct = 100 * int(planned) / int(prompt), 100 * int(cached) / int(prompt)
        gap = round(planned_pct - measured_pct, 2)
    return {
        "preemptions": None if preemptions is None else int(preemptions),
        "planned_hit_pct": None if planned_pct is None else round(planned_pct, 2),
        "measured_hit_pct": None if measured_pct is None else round(measured_pct, 2),
        "hit_rate_gap_points": gap,
    }


def run_phases(database_url: str, batch_ids: list[str], start: float, end: float) -> dict[str, float] | None:
    """Where a run's wall time went, from its work units' timestamps (seconds, summing to wall_s):
    ``to_units`` upload, batch creation, validation and planning, to the first unit queued for an
    engine; ``to_engine`` from there to the first unit a worker started; ``engine`` from that start
    to the last unit's end; ``to_final`` finalization and the poll that saw the last batch final.
    The single-job gap to the engine on sorted lines (issue #24) is found here: which of Freight's
    own steps, or its engine phase, takes the seconds. None where the units cannot be read."""
    import sqlalchemy as sa

    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            row: Any = conn.execute(
                sa.select(
                    sa.func.min(sa.column("enqueued_at")),
                    sa.func.min(sa.column("started_at")),
                    sa.func.max(sa.column("finished_at")),
                )
                .select_from(sa.table("work_units"))
                .where(sa.column("batch_id").in_(batch_ids))
            ).one()
    except sa.exc.SQLAlchemyError:
        return None
    finally:
        engine.dispose()
    queued, started, finished = row
    if queued is None or started is None or finished is None:
        return None
    return {
        "to_units": round(queued - start, 3),
        "to_engine": round(started - queued, 3),
        "engine": round(finished - started, 3),
        "to_final": round(end - finished, 3),
    }


def _list_batches(client: Any, wanted: set[str]) -> list[Any]:
    """This tenant's batches among `wanted`, newest first, paging until all are seen."""
    found: list[Any] = []
    after = None
    while True:
        page = client.batches.list(limit=min(100, len(wanted) + 2), **({"after": after} if after else {}))
        found += [b for b in page.data if b.id in wanted]
        if len(found) >= len(wanted) or not page.has_more or not page.data:
            return found
        after = page.data[-1].id


def main(argv: list[str] | None = None) -> int:
    from bench.workloads import TENANTS, split_multi_job

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, default=Path("var/bench/freight"))
    parser.add_argument("--model", type=Path, default=Path("models/demo"))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument(
        "--multi-job", action="store_true", help="also run each file as 20 batches of 3 tenants"
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"runs": {}}
    with FreightStack(
        args.run_dir,
        args.model,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        tenants=TENANTS,
    ) as stack:
        results["settings"] = stack.settings()
        for path in args.files:
            results["runs"][path.stem] = stack.run_jobs([(TENANTS[0], path)])
            if args.multi_job:
                pieces = split_multi_job(path, args.run_dir / "multi_job")
                jobs = [(p["tenant"], Path(p["path"])) for p in pieces]
                results["runs"][f"{path.stem}-multi_job"] = stack.run_jobs(jobs)  # type: ignore[arg-type]
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
