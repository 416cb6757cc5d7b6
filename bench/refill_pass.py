"""One model's refill pass at fleet scale: the packing pass an engine worker runs after every unit
it records and every pack it takes, timed on a loaded database, this code beside another revision.

At 1,000 workers a fleet runs dozens of these a second (bench/dispatcher_sim.py), each reading
the model's running batches, the first pending units of each and the requests in flight, and
planning a pack or two. Their Python runs on the engine workers' hosts; their statements run on
the one database. This measures both per pass, alone on the machine, so that a change to the pass
is measured without the simulated fleet's own Python beside it.

    python -m bench.refill_pass                              # this code, 10M requests, 1,000 batches
    python -m bench.refill_pass --baseline-rev 0d21c49       # and that revision, in turns

Each system is a child process started with its code's directory first on ``sys.path`` (a git
worktree of ``--baseline-rev``) and the child script from this checkout (``refill_child.py``:
no module of the baseline's is needed beyond the dispatcher and storage it measures). Every
repeat runs every system in turn on the same database, in each of ``CASES``: ``--passes`` passes
each, cycling over the models, each pass after the model's queued and taken units were put back
to pending and the broker emptied (outside the timed pass). In the ``empty`` case the pass then
finds an empty queue and packs ``queue_depth`` packs; in ``one_taken`` a full queue was packed
and its first pack taken first, so it packs one.
Per pass: wall time and the process's CPU time (its Python and its driver's); wall minus CPU is
mostly waiting for PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench import dispatcher_report as rep
from bench.dispatcher_load import Sizes, load
from bench.provenance import STACK, Run, machine_facts, revision
from bench.request_rate import checkout, median
from infra import daemons
from storage.migrate import upgrade
from storage.runtime import Runtime
from storage.settings import Settings

REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "refill_child.py"
RESULTS = REPO / "bench" / "results" / "refill_pass.json"


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/refill_pass.py", "bench/refill_child.py", "bench/dispatcher_load.py")


def log(message: str) -> None:
    print(f"[refill-pass {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


CASES = ("empty", "one_taken")  # the queue a pass finds: see refill_child.py


def run_child(code_dir: Path, settings: dict[str, Any], passes: int, case: str, out: Path) -> dict[str, Any]:
    """``passes`` refill passes by the code in ``code_dir`` (first on the child's ``sys.path``)."""
    program = (
        "import runpy, sys; code, script = sys.argv[1:3]; sys.path.insert(0, code); "
        "sys.argv = [script, *sys.argv[3:]]; runpy.run_path(script, run_name='__main__')"
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            str(code_dir),
            str(CHILD),
            json.dumps(settings),
            str(passes),
            case,
            str(out),
        ],
        cwd=code_dir,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of 10M requests/1,000 batches")
    p.add_argument("--passes", type=int, default=100, help="passes per system per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-rev", help="also run this git revision's pass (a worktree of it), in turns")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    prov = Run("bench.refill_pass", MEASURES, argv)

    run_dir = Path(tempfile.mkdtemp(prefix="freight-refill-"))
    pg = redis = None
    baseline_src = run_dir / "baseline-src"
    systems = {"freight": REPO}
    code = {"freight": revision(REPO)}
    try:
        if args.baseline_rev:
            code["freight_baseline"] = checkout(args.baseline_rev, baseline_src)
            systems["freight_baseline"] = baseline_src
        pg = daemons.start_postgres(run_dir / "pg", daemons.free_port())
        redis = daemons.start_redis(run_dir / "redis", daemons.free_port())
        upgrade(pg.url)
        settings = {
            "data_dir": str(run_dir / "data"),
            "database_url": pg.url,
            "broker_url": redis.url,
            "secret_key": "refill-pass-bench-secret-key",
            # two packs a model whoever asks: the standing queue of revisions before packs were
            # made on ask, so every revision's pass does the same work (no worker asks here)
            "queue_depth": 2,
        }
        rt = Runtime(Settings.from_env({}, **settings))
        sizes = Sizes.at(args.scale)
        loaded = load(rt.db, sizes, int(time.time()), rt.settings.unit_size)
        with rt.db.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
        rt.db.dispose()
        log(f"loaded {loaded.requests:,} requests, {loaded.batches:,} batches, {loaded.units:,} units")
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {n: [] for n in systems} for c in CASES}
        for repeat in range(args.repeats):
            for case in CASES:
                for name, code_dir in systems.items():
                    out = run_dir / f"{name}-{case}-{repeat}.json"
                    result = run_child(code_dir, settings, args.passes, case, out)
                    runs[case][name].append(result)
                    log(
                        f"repeat {repeat + 1} {case} {name}: wall p50 {result['wall_ms']['p50']} ms, "
                        f"CPU p50 {result['cpu_ms']['p50']} ms ({result['dispatcher']})"
                    )
        report = summarize(runs, args, code, loaded.batches, loaded.units)
    finally:
        for service in (redis, pg):
            if service is not None:
                service.stop()
        daemons.stop_all(run_dir)
        if args.baseline_rev:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline_src)], check=False
            )
        shutil.rmtree(run_dir, ignore_errors=True)
    common = report["cases"]["one_taken"]
    report["provenance"] = prov.finish(
        {
            f"refill_pass_{k}_over_baseline": common[f"{k}_over_baseline"]
            for k in ("cpu", "wall")
            if f"{k}_over_baseline" in common
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report.get("targets", {}), indent=1))
    return 0


def summarize(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
    code: dict[str, str],
    batches: int,
    units: int,
) -> dict[str, Any]:
    """Per case: medians per system over every pass of every repeat, and this code over the
    baseline per repeat (the CPU of a pass is the figure the fleet pays on every worker; wall adds
    the database's time). The targets are the ``one_taken`` case's, the refill a fleet runs most."""
    out: dict[str, Any] = {
        "what": "one model's refill pass (workers.dispatcher.enqueue_units(model=...)), per case of CASES",
        "machine": machine_facts(),
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "scale": args.scale,
        "batches": batches,
        "units": units,
        "passes_per_repeat": args.passes,
        "repeats": args.repeats,
        "code": code,
        "cases": {case: cell(by_system) for case, by_system in runs.items()},
    }
    if "freight_baseline" in runs["one_taken"]:
        common = out["cases"]["one_taken"]
        out["targets"] = {
            # the change measured must not make the pass dearer, on the worker or in all
            "refill_pass_cpu_over_baseline": rep.target(common["cpu_over_baseline_median"], 1.0, "<="),
            "refill_pass_wall_over_baseline": rep.target(common["wall_over_baseline_median"], 1.0, "<="),
        }
    return out


def cell(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"systems": {}}
    for name, results in runs.items():
        wall = [v for r in results for v in r["wall_s"]]
        cpu = [v for r in results for v in r["cpu_s"]]
        out["systems"][name] = {
            "wall_ms": rep.summary([v * 1000 for v in wall], 2),
            "cpu_ms": rep.summary([v * 1000 for v in cpu], 2),
            "units_per_pass": rep.summary([v for r in results for v in r["units"]], 1),
            "per_repeat_cpu_ms_p50": [r["cpu_ms"]["p50"] for r in results],
            "dispatcher": results[0]["dispatcher"],
        }
    if "freight_baseline" in runs:
        cpu_ratio = [
            a["cpu_ms"]["p50"] / b["cpu_ms"]["p50"]
            for a, b in zip(runs["freight"], runs["freight_baseline"], strict=True)
        ]
        wall_ratio = [
            a["wall_ms"]["p50"] / b["wall_ms"]["p50"]
            for a, b in zip(runs["freight"], runs["freight_baseline"], strict=True)
        ]
        out["cpu_over_baseline"] = [round(r, 4) for r in cpu_ratio]
        out["wall_over_baseline"] = [round(r, 4) for r in wall_ratio]
        out["cpu_over_baseline_median"] = median(cpu_ratio)
        out["wall_over_baseline_median"] = median(wall_ratio)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
