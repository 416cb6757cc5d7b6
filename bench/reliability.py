"""Reliability figures of issue 8: every fault, load and hostile-input scenario, one run.

The scenarios are the tests marked ``reliability`` (fault injection on the live stack, the API
under a hundred polling clients, big uploads, fuzzing, Schemathesis, auth and rate limits). This
runs them with ``FREIGHT_RELIABILITY_DIR`` set, so each records its figures (at least ``lost``,
``duplicated`` and ``server_errors``), and with the load phase longer than in ``make test``; then it
merges the figures into ``bench/results/reliability.json``, prints them as a bare table and
writes docs/reliability.md's figures from the file (``bench/reliability_doc.py``; not for a trial
run that writes elsewhere with ``--out``). The
``hostile`` scenario (issue 19: one tenant's attacks while two others' batches run) is also written
as the file's top-level ``hostile`` section, with the attack of the ``hostile_dns`` scenario (issue
49: a tenant whose DNS never answers, tests/workers/test_webhook_dns.py, which needs a webhook role
under a resolver of its own and so cannot run on the live stack) beside the others.

    python -m bench.reliability [--load-seconds 120] [-k EXPR] [--out PATH]
    python -m bench.reliability --hostile     # the hostile section's two tests only
    python -m bench.reliability --merge DIR   # figures a test run wrote (FREIGHT_RELIABILITY_DIR=DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import reliability_doc
from bench.provenance import STACK, Run, machine_facts

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "bench" / "results" / "reliability.json"
COUNTS = ("lost", "duplicated", "server_errors")
# the tests of the hostile section: the live stack's attacks, and the slow-DNS tenant's own run
HOSTILE_TESTS = ("test_a_hostile_tenant_harms_no_one", "test_a_tenant_whose_dns_hangs_delays_only_itself")


def measures(tests: Path = REPO / "tests") -> tuple[str, ...]:
    """The repository paths this benchmark measures: a commit to one makes its result stale
    (bench/provenance.py). The stack, this runner, and of tests/ what its pytest run loads: every
    module marked ``reliability`` and every module that is not a test module (conftest.py, the
    factories, the receivers and servers the tests start). A test of something else changing
    leaves the figures as they were."""
    root = tests.parent
    loaded = sorted(
        p.relative_to(root).as_posix()
        for p in tests.rglob("*.py")
        if not p.name.startswith("test_") or "pytest.mark.reliability" in p.read_text()
    )
    return (*STACK, "bench/reliability.py", *loaded)


def run_scenarios(folder: Path, load_seconds: float, select: str | None) -> tuple[int, float, str]:
    env = {**os.environ, "FREIGHT_RELIABILITY_DIR": str(folder), "FREIGHT_LOAD_SECONDS": str(load_seconds)}
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "reliability", "-rA"]
    if select:
        argv += ["-k", select]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    sys.stdout.write(proc.stdout[-4000:])
    return proc.returncode, time.monotonic() - started, summary


def figures_text(entry: dict) -> str:
    """The scenario's own figures, short enough for one table cell."""
    skip = {"scenario", "recorded_at", *COUNTS}
    parts = []
    for key, value in sorted(entry.items()):
        if key in skip or isinstance(value, dict | list):
            continue
        parts.append(f"{key} {value}")
    return "; ".join(parts)


def table(scenarios: dict[str, dict]) -> str:
    rows = ["| scenario | lost | duplicated | 5xx | figures |", "|---|---|---|---|---|"]
    for name, entry in sorted(scenarios.items()):
        rows.append(
            f"| {name} | {entry['lost']} | {entry['duplicated']} | {entry['server_errors']} | {figures_text(entry)} |"
        )
    return "\n".join(rows)


HOSTILE_FIGURES = (
    "api_baseline_rss_mb", "api_peak_rss_mb", "api_bomb_peak_rss_mb", "api_bomb_growth_mb",
    "control_baseline_rss_mb", "control_peak_rss_mb", "control_bomb_peak_rss_mb", "control_bomb_growth_mb",
    "api_conversion_growth_mb", "conversion_output_bytes",
    "api_bomb_one_process_growth_mb", "control_bomb_one_process_growth_mb", "bomb_peak_hwm_growth_mb",
    "rss_bound_mb", "control_sum_bound_mb", "processes_started_after_baseline", "victim_batches",
    "victim_batches_completed",
    "victim_requests", "victim_batch_seconds", "victims_done_at_s", "attacks_while_victims_ran",
    "lost", "duplicated", "server_errors", "responses", "seconds", "recorded_at",
)  # fmt: skip


# the figures of the slow-DNS tenant's run (tests/workers/test_webhook_dns.py), ``dns_`` before each
DNS_FIGURES = (
    "victim_delivery_alone_s", "victim_delivery_during_attack_s", "hung_lookups", "tenant_concurrency",
    "attacker_deliveries", "attacker_attempts", "victim_deliveries", "resolver_timeout_s", "attempt_seconds",
    "lost", "duplicated", "server_errors", "seconds", "recorded_at",
)  # fmt: skip


def hostile_section(scenarios: dict[str, dict]) -> dict | None:
    """Issues 19's and 49's summary of the ``hostile`` scenario (tests/e2e/test_hostile_tenants.py):
    each attack and what it got, the API's and the control worker's RSS (refusing the bombs, and
    while a big output is downloaded as Parquet), the victims' batches. The ``hostile_dns``
    scenario's attack joins the list (its ``at_s`` is None: another run, not timed from the
    victims' submission) and its figures are ``dns_*``; ``lost``, ``duplicated`` and
    ``server_errors`` count both."""
    entry = scenarios.get("hostile")
    if entry is None:
        return None
    section = {"attacks": list(entry["attacks"]), **{k: entry[k] for k in HOSTILE_FIGURES if k in entry}}
    dns = scenarios.get("hostile_dns")
    if dns is not None:
        section["attacks"] += dns["attacks"]
        section.update({f"dns_{k}": dns[k] for k in DNS_FIGURES if k in dns})
        section.update({k: entry[k] + dns[k] for k in COUNTS})
    return section


def writes_the_doc(out: Path) -> bool:
    """Whether a run that wrote ``out`` rewrites docs/reliability.md: only the committed file's."""
    return out.resolve() == RESULT.resolve()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load-seconds", type=float, default=120, help="how long the 100 clients poll")
    parser.add_argument("-k", dest="select", default=None, help="only the scenarios whose tests match")
    parser.add_argument("--merge", type=Path, default=None, help="take the figures in DIR; run nothing")
    parser.add_argument(
        "--hostile", action="store_true", help="only the hostile section's tests (HOSTILE_TESTS)"
    )
    # a partial run (-k, --hostile, --merge) keeps the other scenarios of bench/results/reliability.json
    parser.add_argument("--out", type=Path, default=RESULT, help="write here instead (a scratch path)")
    args = parser.parse_args()
    if args.hostile:
        args.select = " or ".join(HOSTILE_TESTS)
    prov = Run("bench.reliability", measures())
    if args.merge:
        code, duration, summary = 0, 0.0, f"merged from {args.merge}"
        scenarios = {p.stem: json.loads(p.read_text()) for p in sorted(args.merge.glob("*.json"))}
    else:
        with tempfile.TemporaryDirectory(prefix="freight-reliability-") as tmp:
            folder = Path(tmp)
            code, duration, summary = run_scenarios(folder, args.load_seconds, args.select)
            scenarios = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    partial = bool(args.select or args.merge)
    previous = json.loads(RESULT.read_text()).get("scenarios", {}) if RESULT.exists() and partial else {}
    result: dict[str, Any] = {
        "benchmark": "reliability",
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "duration_s": round(duration, 1),
        "pytest": {"exit_code": code, "summary": summary},
        "machine": machine_facts(),
        "settings": {"load_seconds": args.load_seconds, "select": args.select},
        "scenarios": {**previous, **scenarios},  # a -k or --merge run updates its scenarios, keeps the rest
    }
    result["provenance"] = prov.finish()
    result["totals"] = {k: sum(e[k] for e in result["scenarios"].values()) for k in COUNTS}
    hostile = hostile_section(result["scenarios"])
    if hostile is not None:  # issue 19: the attacks of one hostile tenant, on top for readers
        result["hostile"] = hostile
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result["scenarios"]))
    print(f"\n{len(scenarios)} scenarios recorded in {duration:.0f}s; pytest: {summary}; wrote {args.out}")
    if writes_the_doc(args.out):  # the chapter quotes the committed file, whole or partial run
        reliability_doc.write()
        print(f"wrote {reliability_doc.DOC.relative_to(REPO)}'s figures from it")
    sys.exit(code)


if __name__ == "__main__":
    main()
