"""bench/provenance.py: what a benchmark records of its run, and `make bench-status`'s staleness."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import provenance
from bench.provenance import REPO, RESULTS_DIR, Run, staleness, status_lines

# a tiny benchmark: a Run made at its start, its report written with the provenance finished
WRITER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from bench.provenance import Run

    prov = Run("bench.tiny", ["bench/provenance.py"], sys.argv[2:])
    time.sleep(1.1)
    report = {"targets": {"x": {"value": 2.0}}, "provenance": prov.finish({"x": [1.0, 2.0, 3.0]})}
    Path(sys.argv[1]).write_text(json.dumps(report))
    """
)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def test_a_writer_records_its_revision_command_machine_times_and_repeats(tmp_path: Path) -> None:
    out = tmp_path / "results" / "tiny.json"
    out.parent.mkdir()
    head = _git(REPO, "rev-parse", "HEAD").strip()
    dirty = bool(_git(REPO, "status", "--porcelain", "--untracked-files=no").strip())
    subprocess.run([sys.executable, "-c", WRITER, str(out), "--rows", "7"], cwd=REPO, check=True)
    prov = json.loads(out.read_text())["provenance"]
    assert prov["command"] == "python -m bench.tiny --rows 7"
    assert prov["code"]["revision"] == head and prov["code"]["dirty"] is dirty
    assert set(prov["code"]["dirty_measured"]) <= {"bench/provenance.py"}
    assert prov["measures"] == ["bench/provenance.py"]
    machine = prov["machine"]
    assert machine["cores"] >= 1 and machine["memory_gib"] > 0 and machine["cpu_model"]
    assert set(machine["cpu_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert prov["started_at"] < prov["finished_at"] and prov["duration_s"] >= 1.1
    assert prov["repeats"] == {"x": {"n": 3, "values": [1.0, 2.0, 3.0]}}
    # make bench-status reads it: fresh unless provenance.py changed since (or is being changed)
    (line,) = status_lines(out.parent)
    name, rev, state = line.split("\t")
    assert name == "tiny.json" and rev.startswith(head[:12])
    assert state == staleness(prov) and state.startswith(("fresh", "stale: run on uncommitted"))


def test_a_run_must_name_existing_paths_it_measures() -> None:
    with pytest.raises(ValueError, match="measures no path"):
        Run("bench.tiny", [])
    with pytest.raises(ValueError, match="no-such-package"):
        Run("bench.tiny", ["no-such-package"])


def test_a_change_to_what_a_result_measures_makes_it_stale(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "measured").mkdir(parents=True)
    (repo / "measured" / "a.py").write_text("a = 1\n")
    (repo / "other.py").write_text("b = 1\n")
    _git(tmp_path, "init", "-q", str(repo))
    for args in (("add", "."), ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")):
        _git(repo, *args)
    rev = _git(repo, "rev-parse", "HEAD").strip()
    prov = {"code": {"revision": rev, "dirty_measured": []}, "measures": ["measured"]}
    assert staleness(prov, repo) == "fresh"
    (repo / "other.py").write_text("b = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "elsewhere")
    assert staleness(prov, repo) == "fresh"  # a commit elsewhere leaves it fresh
    (repo / "measured" / "a.py").write_text("a = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "measured")
    assert staleness(prov, repo) == "stale: 1 commits since touch measured"
    # undone by a later commit (a revert): the code it ran is the code committed again
    (repo / "measured" / "a.py").write_text("a = 1\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "revert")
    assert staleness(prov, repo) == "fresh"
    (repo / "measured" / "b.py").write_text("b = 1\n")  # a new file is a change too
    _git(repo, "add", "measured/b.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "added")
    assert staleness(prov, repo) == "stale: 3 commits since touch measured"
    unknown = {**prov, "code": {"revision": "0" * 40}}
    assert staleness(unknown, repo) == "stale: its revision is not in this repository"
    dirty = {
        "code": {"revision": _git(repo, "rev-parse", "HEAD").strip(), "dirty_measured": ["measured/a.py"]}
    }
    assert (
        staleness({**dirty, "measures": ["measured"]}, repo)
        == "stale: run on uncommitted changes to measured/a.py"
    )


def test_a_result_measures_the_bench_helpers_its_benchmark_imports(tmp_path: Path) -> None:
    """A helper a benchmark imports (at module level or in a function, transitively) is measured
    with it; the modules that only record a run are not."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "tiny.py").write_text(
        "from bench import runner as r\nfrom bench.provenance import Run\n"
        "def main():\n    from bench.step_checkpoints import StepCheckpoints\n"
    )
    (bench / "runner.py").write_text("import json\nimport bench.events\n")
    (bench / "events.py").write_text("import bench.runner\n")  # a cycle ends
    for name in ("provenance.py", "step_checkpoints.py", "unused.py"):
        (bench / name).write_text("")
    assert provenance.with_imports(["api", "bench/tiny.py"], tmp_path) == [
        "api",
        "bench/tiny.py",
        "bench/runner.py",
        "bench/events.py",
    ]
    # status judges an old record by what its benchmark imports now: a commit to the helper stales it
    repo = tmp_path
    _git(tmp_path, "init", "-q", str(repo))
    for args in (("add", "."), ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")):
        _git(repo, *args)
    prov = {"code": {"revision": _git(repo, "rev-parse", "HEAD").strip()}, "measures": ["bench/tiny.py"]}
    (bench / "unused.py").write_text("x = 1\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "elsewhere")
    assert staleness(prov, repo) == "fresh"
    (bench / "events.py").write_text("import bench.runner\nx = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "helper")
    assert staleness(prov, repo).startswith("stale: 1 commits since touch bench/tiny.py, bench/runner.py")


def test_control_planes_sections_each_carry_their_own_provenance() -> None:
    data = {"dispatcher": {"provenance": {"command": "a"}}, "validation": {"x": 1}, "targets": {}}
    assert [(s, p["command"]) for s, p in provenance.provenances(data)] == [("dispatcher", "a")]


def test_every_result_file_carries_its_provenance() -> None:
    """Every committed result says which command on which code and machine wrote it (#50)."""
    lacking = [
        p.name
        for p in sorted(RESULTS_DIR.glob("*.json"))
        if not list(provenance.provenances(json.loads(p.read_text())))
    ]
    assert lacking == [], f"result files without provenance: re-run them with make bench: {lacking}"
