"""bench/dispatcher_sim.py at a tiny scale on a real PostgreSQL and Redis: the report's shape and
its invariants (every unit claimed once and recorded, fairness computed, no batch starved), and
the figures' pure arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import dispatcher_report as rep
from bench import dispatcher_sim


def test_jain_percentiles_and_gaps() -> None:
    assert rep.jain([5, 5, 5, 5]) == pytest.approx(1.0)
    assert rep.jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert rep.jain([]) is None
    assert rep.percentile([3, 1, 2, 4], 0.5) == 2
    assert rep.percentile([float(i) for i in range(1, 101)], 0.99) == 99
    served = [(0.5, "a", 10), (30, "b", 10), (61, "a", 20), (70, "b", 0)]
    assert rep.jain_per_window(served, ["a", "b"], 0.0, 125.0) == [1.0, 0.5]
    gaps = rep.longest_gaps({"x": [10.0, 50.0], "y": [5.0]}, {"x": 50.0, "y": float("inf")}, 0.0, 100.0)
    assert gaps == {"x": 40.0, "y": 95.0}


def test_a_batch_starves_only_while_none_of_its_units_is_on_a_worker() -> None:
    # unit 1 claimed at 10 and recorded at 70; unit 2 claimed twice (the first attempt lost),
    # recorded at 95; unit 3 claimed at 90 and never recorded
    stretches = rep.on_worker([(1, 10.0), (2, 20.0), (2, 60.0), (3, 90.0)], [(1, 70.0), (2, 95.0)], 100.0)
    assert stretches == {1: [(10.0, 70.0)], 2: [(20.0, 60.0), (60.0, 95.0)], 3: [(90.0, 100.0)]}
    served = {
        "busy": [(10.0, 70.0), (60.0, 95.0)],  # no new claim from 10 to 60, but never without service
        "idle": [(10.0, 20.0), (80.0, 90.0)],  # nothing on a worker from 20 to 80
        "never": [],
        "done": [(0.0, 5.0)],  # its last unit was claimed at 0: nothing left to wait for after
    }
    due = {"busy": float("inf"), "idle": float("inf"), "never": float("inf"), "done": 0.0}
    assert rep.longest_unserved(served, due, 0.0, 100.0) == {
        "busy": 10.0,
        "idle": 60.0,
        "never": 100.0,
        "done": 0.0,
    }


def test_tiny_scale_run_claims_every_unit_once(tmp_path) -> None:
    out = tmp_path / "control_plane.json"
    out.write_text(json.dumps({"other": {"kept": True}, "targets": {"other_target": {"pass": True}}}))
    report = dispatcher_sim.main(
        ["--scale", "0.004", "--drain", "--worker-rps", "4000", "--fleet-procs", "2", "--tick-seconds", "0.5",
         "--max-seconds", "120", "--fairness-seconds", "1", "--out", str(out)]
    )  # fmt: skip
    claims = report["claims"]
    assert claims["claimed"] == claims["units"] > 0
    assert claims["claimed_more_than_once"] == 0 and claims["units_not_done"] == 0
    assert claims["max_attempts"] == 1 and report["errors"] == []
    assert report["requests_served"] == report["sizes"]["requests"]
    assert report["tick"]["n"] > 0 and report["tick"]["max"] is not None
    assert report["runnable_to_claim_s"]["n"] == claims["units"]
    assert report["jain_per_window"] and all(0 < j <= 1 for j in report["jain_per_window"])
    equal = report["jain_equal_priority_per_window"]
    assert equal and all(0 < j <= 1 for j in equal) and report["jain_equal_priority_min"] == min(equal)
    assert 0 <= report["urgent_share_of_served"] <= 1
    assert report["starved_batches"] == 0 and report["longest_unserved_s"]["n"] == report["sizes"]["batches"]
    # every worker asked for packs, and each ask ended in a claim
    assert report["ask_to_claim_s"]["n"] >= report["sizes"]["workers"]
    assert report["run"]["join_seconds"] == round(1024 / 4000, 1)
    assert report["machine"]["cores"] and report["notes"]
    # where the window's CPU went: the database, the broker, the dispatcher, the simulated fleet
    cpu = report["cpu"]
    assert set(cpu["cpu_s"]) == {"postgres", "redis", "dispatcher", "fleet"}
    assert cpu["cpu_s"]["postgres"] > 0 and cpu["cpu_s"]["fleet"] > 0 and cpu["cpu_s"]["dispatcher"] > 0
    assert 0 < sum(cpu["cores_busy"].values()) <= cpu["machine_cores_busy"] + 0.05 <= cpu["cores"] + 0.05
    assert 0 <= cpu["unattributed_cores_busy"] <= cpu["machine_cores_busy"]
    written = json.loads(out.read_text())
    assert written["other"] == {"kept": True} and written["targets"]["other_target"] == {"pass": True}
    assert set(written["targets"]) >= {
        "dispatcher_tick_s",
        "runnable_to_claim_p99_s",
        "jain_index",
        "starved_batches",
    }
    for name in ("dispatcher_tick_s", "runnable_to_claim_p99_s", "jain_index", "starved_batches"):
        assert set(written["targets"][name]) >= {"value", "bound", "pass"}
    assert written["dispatcher"]["sizes"] == report["sizes"]
    # the section records the run that wrote it (bench/provenance.py)
    prov = written["dispatcher"]["provenance"]
    assert prov["command"].startswith("python -m bench.dispatcher_sim --scale 0.004 --drain")
    assert prov["code"]["revision"] and "workers" in prov["measures"] and prov["machine"]["cores"]


def test_pin_gives_the_shared_components_one_cpu_and_the_fleet_the_rest() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    procs = {
        role: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        for role in ("postgres", "fleet0")
    }
    try:
        pinned = dispatcher_sim.pin({role: p.pid for role, p in procs.items()})
        if len(cpus) < 2:
            assert pinned is None
            return
        assert pinned == {"shared": cpus[:1], "fleet": cpus[1:]}
        assert sorted(os.sched_getaffinity(procs["postgres"].pid)) == cpus[:1]
        assert sorted(os.sched_getaffinity(procs["fleet0"].pid)) == cpus[1:]
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
