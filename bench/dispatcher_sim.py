"""The dispatcher at fleet scale (issue #21 s3): Freight's real tick, packing, claims and records on
a real PostgreSQL and Redis, with engine workers simulated (bench/dispatcher_fleet.py).

    python -m bench.dispatcher_sim [--scale 1.0] [--duration 360] [--warmup 60] [--drain]

At scale 1: 10,000,000 requests queued in 1,000 batches of 100 tenants, 1,000 simulated workers
over 10 models; ``--scale`` multiplies every size (bench/dispatcher_load.py). The workers cannot be
1,000 processes on a small machine: ``--fleet-procs`` processes each model a share of them, their
database and broker work on ``--op-threads`` record threads and ``--take-threads`` take threads
(together fewer than the connection pool holds). ``--drain`` runs until every unit is recorded
(the smoke test's mode) instead of for ``--duration`` seconds. Writes the ``dispatcher`` section
and its targets into bench/results/control_plane.json (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import func, select, text, update

from bench import cpu
from bench import dispatcher_report as rep
from bench.dispatcher_fleet import run_dispatcher, run_fleet
from bench.dispatcher_load import Sizes, load
from bench.freeze import tree
from bench.provenance import STACK, Run, machine_facts
from infra import daemons
from storage.migrate import upgrade
from storage.models import Batch, WorkUnit
from storage.runtime import Runtime
from storage.settings import Settings
from storage.status import UnitStatus
from workers import dispatcher

RESULTS = Path(__file__).resolve().parent / "results" / "control_plane.json"
QUIET_ASKS = 2  # workers of each model waiting for a pack in quiet_ticks
BOUNDS = {"dispatcher_tick_s": 1.0, "runnable_to_claim_p99_s": 2.0, "jain_index": 0.9, "starved_batches": 0}


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (
    *STACK,
    "bench/dispatcher_sim.py",
    "bench/dispatcher_fleet.py",
    "bench/dispatcher_load.py",
    "bench/dispatcher_report.py",
)


def log(message: str) -> None:
    print(f"[dispatcher-sim {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--scale", type=float, default=1.0, help="fraction of 10M requests/1,000 batches/1,000 workers"
    )
    p.add_argument("--duration", type=float, default=360.0, help="seconds the fleet runs (without --drain)")
    p.add_argument(
        "--warmup",
        type=float,
        default=120.0,
        help="seconds left out of the figures (the fleet joining, ramp-up)",
    )
    p.add_argument("--drain", action="store_true", help="run until every unit is recorded")
    p.add_argument("--max-seconds", type=float, default=1200.0, help="--drain gives up after this long")
    p.add_argument(
        "--worker-rps", type=float, default=10.0, help="modelled requests/s of one worker's engine"
    )
    p.add_argument(
        "--join-seconds",
        type=float,
        help="each simulated worker comes up at a random moment of the run's first this many seconds, as "
        "engines finish loading at different times (default: one pack's engine time, "
        "FREIGHT_PACK_REQUESTS / --worker-rps; 0: all at once)",
    )
    p.add_argument(
        "--unit-time-spread",
        type=float,
        default=0.25,
        help="sigma of the lognormal factor (mean 1) of each unit's modelled engine time (0: identical)",
    )
    p.add_argument("--seed", type=int, default=21, help="seeds the workload and the simulated fleet")
    p.add_argument(
        "--pack-requests",
        type=int,
        help="FREIGHT_PACK_REQUESTS for this run (default: Freight's; the simulated look-ahead follows it)",
    )
    p.add_argument("--fleet-procs", type=int, default=4, help="processes the simulated workers share")
    p.add_argument(
        "--op-threads",
        type=int,
        default=8,
        help="threads of a fleet process doing its workers' records (and the refills after them)",
    )
    p.add_argument(
        "--take-threads",
        type=int,
        default=4,
        help="threads of a fleet process taking its workers' packs and asking for the next ones",
    )
    p.add_argument("--tick-seconds", type=float, default=2.0, help="dispatcher period (FREIGHT_TICK_SECONDS)")
    p.add_argument(
        "--starve-seconds",
        type=float,
        default=120.0,
        help="longest a batch with unclaimed units may go with none of its units on a worker",
    )
    p.add_argument("--fairness-seconds", type=float, default=60.0, help="window of Jain's index (a minute)")
    p.add_argument(
        "--pin",
        action="store_true",
        help="PostgreSQL, Redis and the dispatcher on CPU 0, the simulated fleet on the others: the "
        "fleet's Python (on its own hosts in a real fleet) cannot take the measured components' CPU",
    )
    p.add_argument("--label", default="", help="what this run is (before/after a change), kept in the report")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep", type=Path, help="also write the raw logs of every process into this folder")
    p.add_argument(
        "--pg-stats",
        action="store_true",
        help="with --keep: load pg_stat_statements and auto_explain (plans of statements over "
        "--explain-ms, with ANALYZE) and write the top statements and the server log into --keep",
    )
    p.add_argument("--explain-ms", type=int, default=200, help="auto_explain.log_min_duration (ms)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    prov = Run("bench.dispatcher_sim", MEASURES, argv)
    sizes = Sizes.at(args.scale)
    run_dir = Path(tempfile.mkdtemp(prefix="freight-dispatch-sim-"))
    pg = redis = None
    try:
        pg = daemons.start_postgres(run_dir / "pg", daemons.free_port())
        if args.pg_stats:
            pg = with_statement_stats(pg, args.explain_ms)
        redis = daemons.start_redis(run_dir / "redis", daemons.free_port())
        upgrade(pg.url)
        settings = {
            "data_dir": str(run_dir / "data"),
            "database_url": pg.url,
            "broker_url": redis.url,
            "secret_key": "dispatcher-sim-bench-secret-key",
        }
        if args.pack_requests:
            settings["pack_requests"] = args.pack_requests
        report = run(args, sizes, settings, run_dir, {"postgres": pg.pid, "redis": redis.pid}, prov)
        if args.pg_stats and args.keep:
            keep_statement_stats(pg, args.keep)
        return report
    finally:
        for service in (redis, pg):
            if service is not None:
                service.stop()
        daemons.stop_all(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)


def with_statement_stats(pg: daemons.PostgresService, explain_ms: int) -> daemons.PostgresService:
    """The cluster restarted with pg_stat_statements and auto_explain loaded: the database's own
    account of where the tick's, claims' and records' time goes under the fleet's load."""
    with (pg.data_dir / "postgresql.conf").open("a") as conf:
        conf.write(
            "shared_preload_libraries = 'pg_stat_statements,auto_explain'\n"
            "pg_stat_statements.track = all\n"
            f"auto_explain.log_min_duration = {explain_ms}\n"
            "auto_explain.log_analyze = on\n"
            "auto_explain.log_buffers = on\n"
            "auto_explain.log_nested_statements = on\n"
        )
    pg = daemons.restart_postgres(pg)
    with pg_connect(pg.url) as conn:
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
    return pg


def pg_connect(url: str) -> Any:
    from sqlalchemy import create_engine

    return create_engine(url, isolation_level="AUTOCOMMIT").connect()


def keep_statement_stats(pg: daemons.PostgresService, keep: Path) -> None:
    """The 40 statements of most total time (calls, mean, max, rows) and the server log with
    auto_explain's plans, into ``keep``."""
    with pg_connect(pg.url) as conn:
        rows = conn.execute(
            text(
                "SELECT calls, round(total_exec_time::numeric, 1) AS total_ms, "
                "round(mean_exec_time::numeric, 2) AS mean_ms, round(max_exec_time::numeric, 1) AS max_ms, "
                "rows, shared_blks_hit + shared_blks_read AS blocks, left(query, 600) AS query "
                "FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 40"
            )
        ).mappings()
        top = [{k: (float(v) if k.endswith("_ms") else v) for k, v in row.items()} for row in rows]
    keep.mkdir(parents=True, exist_ok=True)
    (keep / "pg_stat_statements.json").write_text(json.dumps(top, indent=1))
    shutil.copy(pg.log_path, keep / "postgres.log")


def run(
    args: argparse.Namespace,
    sizes: Sizes,
    settings: dict[str, Any],
    run_dir: Path,
    services: dict[str, int],
    prov: Run,
) -> dict[str, Any]:
    """``services``: the pids of PostgreSQL and Redis, whose CPU is measured beside the fleet's;
    ``prov``: the run's provenance, finished into the section it writes."""
    rt = Runtime(Settings.from_env({}, **settings))
    t0 = time.time()
    loaded = load(rt.db, sizes, int(t0), rt.settings.unit_size, seed=args.seed)
    with rt.db.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
    log(
        f"loaded {loaded.requests:,} requests in {loaded.batches:,} batches, {loaded.units:,} units "
        f"in {time.time() - t0:.1f}s; {sizes.workers:,} workers over {sizes.models} models"
    )
    quiet = quiet_ticks(rt, 5)
    log(f"the tick alone on the loaded database: {quiet}")
    procs = max(1, min(args.fleet_procs, sizes.workers))
    share, extra = divmod(sizes.workers, procs)
    slices, first = [], 0
    for k in range(procs):
        count = share + (1 if k < extra else 0)
        slices.append((first, count))
        first += count
    config = {
        "settings": settings,
        "models": sizes.model_names(),
        "worker_rps": args.worker_rps,
        "fleet_slices": slices,
        "op_threads": args.op_threads,
        "take_threads": args.take_threads,
        "join_seconds": join_seconds(args, rt.settings.pack_requests),
        "unit_time_spread": args.unit_time_spread,
        "seed": args.seed,
        "tick_seconds": args.tick_seconds,
    }
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    logs = run_dir / "logs"
    logs.mkdir()
    children = [ctx.Process(target=run_dispatcher, args=(config, stop, str(logs / "dispatcher.json")))]
    children += [
        ctx.Process(target=run_fleet, args=(config, k, stop, str(logs / f"fleet{k}.json")))
        for k in range(procs)
    ]
    started = time.time()
    for child in children:
        child.start()
    roles = {**services, "dispatcher": children[0].pid or 0}
    roles.update({f"fleet{k}": child.pid or 0 for k, child in enumerate(children[1:])})
    pinned = pin(roles) if args.pin else None
    window_start = started if args.drain else started + args.warmup
    cpu_before: tuple[float, dict[str, float], float] | None = None
    deadline = started + (args.max_seconds if args.drain else args.duration)
    while time.time() < deadline and all(c.is_alive() for c in children):
        if cpu_before is None and time.time() >= window_start:
            cpu_before = (time.time(), cpu.snapshot(roles), cpu.machine_seconds())
        time.sleep(1.0)
        if args.drain and unfinished(rt) == 0:
            break
    ended = time.time()
    cpu_window = cpu_split(roles, cpu_before)  # before the stop: every pool's backends still live
    stop.set()
    for child in children:
        child.join(timeout=120)
    log(f"fleet ran {ended - started:.0f}s")
    raw = {p.stem: json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        for name, data in raw.items():
            (args.keep / f"{name}.json").write_text(json.dumps(data))
    window = (started if args.drain else started + args.warmup, ended)
    report = build(args, sizes, loaded.units, rt, raw, window, started, ended)
    if args.keep:
        keep_units(rt, args.keep / "units.csv")
    report["tick"]["alone_s"] = quiet
    report["cpu"] = cpu_window
    report["run"]["pinned"] = pinned
    rt.db.dispose()
    targets = report.pop("targets")
    report["provenance"] = prov.finish()
    rep.merge_results(args.out, report, targets)
    log(json.dumps({"targets": targets}, indent=1))
    return {**report, "targets": targets}


def join_seconds(args: argparse.Namespace, pack_requests: int) -> float:
    """Over how long the simulated workers come up. All at once, with every unit of a size taking
    the same time, the whole fleet kept the phase it started in: every worker asked for its next
    pack in the same 60 s of each 102 s (one pack's time at 10 requests/s), and packs queued
    just before the quiet 40 s waited through them (a run of 2026-11-28: no claim in the whole
    fleet for 40 s twice in 240 s; runnable-to-claim p99 33 s)."""
    return args.join_seconds if args.join_seconds is not None else pack_requests / args.worker_rps


def pin(roles: dict[str, int]) -> dict[str, list[int]] | None:
    """CPU 0 for PostgreSQL, Redis and the dispatcher (every process of theirs: backends forked
    later inherit the postmaster's), the other CPUs for the fleet's processes, set right after
    they start (the threads they make later inherit it). None on a one-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    shared, rest = {cpus[0]}, set(cpus[1:])
    for role, pid in roles.items():
        for proc in tree([pid]):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                os.sched_setaffinity(proc.pid, rest if role.startswith("fleet") else shared)
    return {"shared": sorted(shared), "fleet": sorted(rest)}


def cpu_split(roles: dict[str, int], before: tuple[float, dict[str, float], float] | None) -> dict[str, Any]:
    """CPU seconds per second of the measured window, by role (PostgreSQL with its backends,
    Redis, the dispatcher, the simulated fleet's processes summed), and the machine's.

    Why: a real fleet's engine workers run on their own hosts, so their Python work (claims,
    records, refills, heartbeats) costs the shared components nothing but database and broker
    time; here all of it runs on this host's cores. Where the window's CPU goes says which of the
    targets' misses are the shared database and dispatcher, and which are the simulation's own
    processes crowding them out."""
    if before is None:
        return {}
    t0, at_start, machine_start = before
    seconds = max(1e-9, time.time() - t0)
    used = cpu.spent(at_start, cpu.snapshot(roles))
    fleet = sum(v for k, v in used.items() if k.startswith("fleet"))
    per_role = {k: v for k, v in used.items() if not k.startswith("fleet")} | {"fleet": round(fleet, 2)}
    machine = cpu.machine_seconds() - machine_start
    return {
        "window_s": round(seconds, 1),
        "cores": os.cpu_count(),
        "cpu_s": per_role,
        "cores_busy": {k: round(v / seconds, 2) for k, v in per_role.items()},
        "machine_cores_busy": round(machine / seconds, 2),
        # the machine's busy time no live role holds: mostly PostgreSQL backends that exited
        # within the window (a pool's overflow connections close when returned), and this process
        "unattributed_cores_busy": round(max(0.0, machine - sum(per_role.values())) / seconds, 2),
    }


def keep_units(rt: Runtime, path: Path) -> None:
    """Every unit's row as the run left it (its batch, tenant, timings), for analysis after the run."""
    import csv

    with rt.db.read() as s, path.open("w", newline="") as out:
        rows = s.execute(
            select(
                WorkUnit.id,
                WorkUnit.batch_id,
                Batch.tenant_id,
                WorkUnit.model,
                WorkUnit.seq,
                WorkUnit.n_requests,
                WorkUnit.status,
                WorkUnit.attempts,
                WorkUnit.enqueued_at,
                WorkUnit.started_at,
                WorkUnit.finished_at,
                WorkUnit.pack_id,
                Batch.expires_at,
                Batch.priority,
            ).join(Batch, Batch.id == WorkUnit.batch_id)
        )
        writer = csv.writer(out)
        writer.writerow(rows.keys())
        writer.writerows(rows)


def quiet_ticks(rt: Runtime, n: int) -> list[float]:
    """The tick's own cost, before any worker runs: ``n`` ticks on the loaded database, each
    packing two packs per model, as if two workers of each waited (the standing queue's depth
    before packs were made on ask: these figures compare with the runs before); between them the
    packs are undone (units back to pending, queues and asks emptied), so each tick does the same
    work."""
    out = []
    with rt.db.read() as s:
        models = sorted(m for m in s.scalars(select(WorkUnit.model).distinct()) if m is not None)
    for _ in range(n):
        for model in models:
            for k in range(QUIET_ASKS):
                rt.queue.asks.add(model, f"quiet-{k}", time.time(), 3600)
        t0 = time.perf_counter()
        dispatcher.tick(rt, time.time())
        out.append(round(time.perf_counter() - t0, 4))
        with rt.db.write() as s:
            s.execute(
                update(WorkUnit)
                .where(WorkUnit.status == UnitStatus.QUEUED)
                .values(status=UnitStatus.PENDING, pack_id=None, enqueued_at=None)
            )
        with rt.queue.celery.connection_for_write() as conn:
            conn.default_channel.client.flushdb()
    return out


def unfinished(rt: Runtime) -> int:
    with rt.db.read() as s:
        return int(s.scalar(select(func.count()).where(WorkUnit.status.not_in(UnitStatus.FINISHED))) or 0)


def console_and_metrics_seconds(rt: Runtime) -> dict[str, float]:
    """One ``/metrics`` snapshot and one console "Models & workers" read on the final database."""
    from api.services.monitoring import metrics_snapshot

    out = {}
    t0 = time.perf_counter()
    metrics_snapshot(rt, time.time())
    out["metrics_snapshot_s"] = round(time.perf_counter() - t0, 4)
    return out


def build(
    args: argparse.Namespace,
    sizes: Sizes,
    n_units: int,
    rt: Runtime,
    raw: dict[str, Any],
    window: tuple[float, float],
    started: float,
    ended: float,
) -> dict[str, Any]:
    w0, w1 = window
    fleets = [v for k, v in raw.items() if k.startswith("fleet")]
    ticks = raw.get("dispatcher", {}).get("ticks", [])
    with rt.db.read() as s:
        units = s.execute(
            select(
                WorkUnit.id,
                WorkUnit.batch_id,
                WorkUnit.status,
                WorkUnit.enqueued_at,
                WorkUnit.started_at,
                WorkUnit.attempts,
                WorkUnit.n_requests,
            )
        ).all()
        tenant_of = dict(s.execute(select(Batch.id, Batch.tenant_id)).all())
    unit_batch = {u.id: u.batch_id for u in units}
    claims = [c for f in fleets for c in f["claims"]]
    records = [r for f in fleets for r in f["records"] if r[4] >= 0]
    claim_count = Counter(c[0] for c in claims)
    in_window = [t for t in ticks if w0 <= t["at"] <= w1]
    # runnable (queued in a pack message) -> claimed, per unit claimed in the window
    to_claim = [
        u.started_at - u.enqueued_at
        for u in units
        if u.started_at is not None and u.enqueued_at is not None and w0 <= u.started_at <= w1
    ]
    served = [(r[1], tenant_of[unit_batch[r[0]]], r[4]) for r in records]
    per_minute = rep.jain_per_window(served, tenant_of.values(), w0, w1, args.fairness_seconds)
    # between tenants of equal priority: urgent units (a batch short of slack for its deadline,
    # within the tenant's urgent share) go first by design, so they are left out here
    equal = [(r[1], tenant_of[unit_batch[r[0]]], r[4]) for r in records if not r[5]]
    equal_per_minute = rep.jain_per_window(equal, tenant_of.values(), w0, w1, args.fairness_seconds)
    urgent_served = sum(r[4] for r in records if r[5] and w0 <= r[1] <= w1)
    window_served = sum(r[4] for r in records if w0 <= r[1] <= w1)
    claim_times: dict[str, list[float]] = defaultdict(list)
    last_claim: dict[str, float] = {}
    for unit_id, at, _ in claims:
        claim_times[unit_batch[unit_id]].append(at)
    for batch, times in claim_times.items():
        last_claim[batch] = max(times)
    waiting_batches = {u.batch_id for u in units if u.started_at is None}
    due = {b: (float("inf") if b in waiting_batches else last_claim.get(b, w0)) for b in tenant_of}
    gaps = rep.longest_gaps(claim_times, due, w0, w1)
    served_by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    stretches = rep.on_worker(((c[0], c[1]) for c in claims), ((r[0], r[1]) for r in records), w1)
    for unit_id, spans in stretches.items():
        served_by[unit_batch[unit_id]].extend(spans)
    unserved = rep.longest_unserved(served_by, due, w0, w1)
    starved = sorted(b for b, gap in unserved.items() if gap > args.starve_seconds)
    idle = [seconds for f in fleets for at, seconds in f["idle"] if w0 <= at <= w1]
    busy = sum(sum(f["busy_seconds"].values()) for f in fleets)
    tick_seconds = [t["seconds"] for t in in_window]
    phase_max: dict[str, float] = defaultdict(float)
    for t in in_window:
        for name, sec in t["phases"].items():
            phase_max[name] = max(phase_max[name], sec)
    requests_served = sum(r[4] for r in records)
    report: dict[str, Any] = {
        "label": args.label,
        "machine": {**machine_facts(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "scale": args.scale,
        "sizes": {
            "requests": sizes.requests,
            "batches": sizes.batches,
            "tenants": sizes.tenants,
            "models": sizes.models,
            "workers": sizes.workers,
            "units": n_units,
        },
        "settings": {
            k: getattr(rt.settings, k)
            for k in (
                "unit_size",
                "pack_requests",
                "queue_depth",
                "heartbeat_seconds",
                "sample_seconds",
                "lease_seconds",
                "urgent_slack_seconds",
            )
        },
        "run": {
            "mode": "drain" if args.drain else "duration",
            "seconds": round(ended - started, 1),
            "warmup_seconds": 0 if args.drain else args.warmup,
            "measured_seconds": round(w1 - w0, 1),
            "worker_rps": args.worker_rps,
            "fleet_processes": len(fleets),
            "op_threads_per_process": args.op_threads,
            "take_threads_per_process": args.take_threads,
            "join_seconds": round(join_seconds(args, rt.settings.pack_requests), 1),
            "unit_time_spread": args.unit_time_spread,
            "seed": args.seed,
            "tick_period_s": args.tick_seconds,
        },
        "tick": {
            **rep.summary(tick_seconds),
            "waiting_requests_at_first": in_window[0]["waiting_requests"] if in_window else None,
            "phase_max_s": {k: round(v, 4) for k, v in phase_max.items()},
        },
        "runnable_to_claim_s": rep.summary(to_claim),
        "claim_db_s": rep.summary([c[2] for c in claims]),
        "record_db_s": rep.summary([r[2] for r in records]),
        "refill_after_record_s": rep.summary([r[3] for r in records]),
        "refill_after_ask_s": rep.summary([p for f in fleets for p in f["pokes"]]),
        "worker_idle_wait_s": rep.summary(idle),
        "asks_lapsed": sum(f.get("asks_lapsed", 0) for f in fleets),
        "op_wait_s": {
            kind: rep.summary([s for f in fleets for s in f.get("op_waits", {}).get(kind, ())])
            for kind in ("record", "take", "ask")
        },
        "ask_to_claim_s": rep.summary([s for f in fleets for at, s in f.get("asks", ()) if w0 <= at <= w1]),
        "fleet_utilization": round(busy / (sizes.workers * (ended - started)), 4),
        "requests_served": requests_served,
        "requests_per_s": round(requests_served / max(1e-9, ended - started), 1),
        "jain_window_s": args.fairness_seconds,
        "jain_per_window": per_minute,
        "jain_min": min(per_minute) if per_minute else None,
        "jain_mean": round(sum(per_minute) / len(per_minute), 4) if per_minute else None,
        "jain_equal_priority_per_window": equal_per_minute,
        "jain_equal_priority_min": min(equal_per_minute) if equal_per_minute else None,
        "urgent_share_of_served": round(urgent_served / window_served, 4) if window_served else None,
        "longest_claim_gap_s": rep.summary(list(gaps.values()), 1),
        "batches_with_claim_gap_over_starve_s": sum(1 for gap in gaps.values() if gap > args.starve_seconds),
        "longest_unserved_s": rep.summary(list(unserved.values()), 1),
        "starved_batches": len(starved),
        "batches_never_claimed_in_window": sum(
            1 for b in waiting_batches if not any(w0 <= t <= w1 for t in claim_times.get(b, ()))
        ),
        "starved_examples": starved[:10],
        "claims": {
            "units": n_units,
            "claimed": len(claim_count),
            "claimed_more_than_once": sum(1 for n in claim_count.values() if n > 1),
            "lost_claims": sum(f["lost_claims"] for f in fleets),
            "units_not_done": sum(1 for u in units if u.status != UnitStatus.DONE),
            "max_attempts": max((u.attempts for u in units), default=0),
        },
        "errors": ([e for f in fleets for e in f["errors"]] + [t["error"] for t in ticks if t.get("error")])[
            :20
        ],
        "queries": console_and_metrics_seconds(rt),
        "notes": [
            f"{sizes.workers} simulated workers in {len(fleets)} processes (plus one dispatcher process): "
            f"each process models its workers' engines on one clock thread and does their claims, records "
            f"and refills on {args.op_threads} record threads and {args.take_threads} take threads (a "
            "worker's claims, asks and the refills after them: a real worker's main thread) over its own "
            "SQLAlchemy pool (5 + 10 overflow connections); op_wait_s: an operation's wait for a thread; "
            "engine time is modelled (a unit's requests at worker_rps, times a lognormal factor of mean 1 "
            "and sigma unit_time_spread; the workers come up at random moments of the first join_seconds), "
            "everything else is Freight's code on real PostgreSQL and Redis",
            "heartbeats and engine_samples rows are written per process in one transaction every "
            "FREIGHT_HEARTBEAT_SECONDS / FREIGHT_SAMPLE_SECONDS (a real fleet: one per worker); the "
            "engine worker's 1 s cancellation check is not simulated",
            "tick.alone_s: the tick on the loaded database before any worker runs (each packing two "
            "packs per model for two asks, the packs undone between ticks): its own cost, apart from "
            "the fleet's load",
            "packs are made on ask (FREIGHT_QUEUE_DEPTH 0): a worker whose look-ahead runs short asks "
            "(PackAsks.add) and refills its model (refill_after_ask_s), then waits on the queue",
            "runnable-to-claim: pack message sent (enqueued_at) to claim_unit (started_at); worker_idle_wait: "
            "a worker with nothing claimed, until its next pack arrived; ask_to_claim: a worker asking for "
            "its next pack (its look-ahead running short) until it holds that pack's first claim",
            "jain_index: worst full minute of the measured window, requests recorded per tenant of the "
            "units not sent as urgent (jain_equal_priority_*: tenants are alike, and an urgent unit goes "
            "first by design); jain_per_window: all requests, urgent ones too; starved: a batch with unclaimed units and none on a worker for "
            "starve_seconds (batches_with_claim_gap_over_starve_s: no new claim for that long, the "
            "definition before 2026-11-28, which counted urgent batches whose many units were running)",
            rep.__doc__.split("Definitions")[0].strip(),
        ],
    }
    report["targets"] = {
        "dispatcher_tick_s": rep.target(report["tick"]["max"], BOUNDS["dispatcher_tick_s"], "<="),
        "runnable_to_claim_p99_s": rep.target(
            report["runnable_to_claim_s"]["p99"], BOUNDS["runnable_to_claim_p99_s"], "<="
        ),
        "jain_index": rep.target(report["jain_equal_priority_min"], BOUNDS["jain_index"], ">="),
        "starved_batches": rep.target(len(starved), BOUNDS["starved_batches"], "<="),
    }
    return report


if __name__ == "__main__":
    main()
