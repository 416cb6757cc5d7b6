"""bench/refill_pass.py at a tiny scale on a real PostgreSQL and Redis, with this checkout's HEAD as
the baseline: both systems ran their own code on the same database, every pass queued units, and
the report carries its ratios and targets."""

from __future__ import annotations

import json
import subprocess

from bench import refill_pass
from tests.conftest import REPO


def test_a_tiny_run_measures_this_code_and_the_baseline_in_turns(tmp_path) -> None:
    out = tmp_path / "refill_pass.json"
    assert refill_pass.main(["--scale", "0.004", "--passes", "3", "--repeats", "2", "--baseline-rev", "HEAD",
                             "--out", str(out)]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert report["batches"] == 4 and report["units"] > 0 and report["machine"]["cores"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert report["code"]["freight_baseline"] == head
    # the targets' per-repeat ratios are in the run's provenance, one a repeat
    repeats = report["provenance"]["repeats"]
    assert (
        repeats["refill_pass_cpu_over_baseline"]["n"] == repeats["refill_pass_wall_over_baseline"]["n"] == 2
    )
    assert set(report["cases"]) == set(refill_pass.CASES)
    for case in report["cases"].values():
        systems = case["systems"]
        assert set(systems) == {"freight", "freight_baseline"}
        assert systems["freight"]["dispatcher"] == str(REPO / "workers" / "dispatcher.py")
        # the baseline ran the worktree's code, not this checkout's
        assert not systems["freight_baseline"]["dispatcher"].startswith(str(REPO))
        for system in systems.values():
            assert system["wall_ms"]["n"] == 6 and system["cpu_ms"]["p50"] > 0
            assert system["units_per_pass"]["p50"] > 0  # every pass packed something
        assert len(case["cpu_over_baseline"]) == len(case["wall_over_baseline"]) == 2
    targets = report["targets"]
    assert set(targets) == {"refill_pass_cpu_over_baseline", "refill_pass_wall_over_baseline"}
    assert all(set(t) >= {"value", "bound", "pass"} for t in targets.values())
    # the worktree is gone
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
    assert "baseline-src" not in worktrees
