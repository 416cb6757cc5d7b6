"""bench/resume.py: `make bench` runs a benchmark again only when its result does not stand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.provenance import REPO, machine_facts
from bench.resume import why_run

HERE = {"cpu_model": "AMD EPYC", "cores": 2, "cpu_flags": {"avx2": True, "avx512_bf16": True}}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def _repo(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "repo"
    (repo / "measured").mkdir(parents=True)
    (repo / "measured" / "a.py").write_text("a = 1\n")
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return repo, _git(repo, "rev-parse", "HEAD").strip()


def _result(results: Path, name: str, rev: str, command: str, machine: dict, section: str = "") -> None:
    prov = {
        "command": command,
        "code": {"revision": rev, "dirty": False, "dirty_files": [], "dirty_measured": []},
        "measures": ["measured"],
        "machine": machine,
    }
    data = {section: {"provenance": prov}} if section else {"provenance": prov}
    (results / name).write_text(json.dumps(data))


def test_a_fresh_result_of_the_same_command_and_machine_kind_is_not_run_again(tmp_path: Path) -> None:
    repo, rev = _repo(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    command = ["bench.lora", "--repeats", "3"]
    _result(results, "lora.json", rev, "python -m bench.lora --repeats 3", HERE)
    assert why_run("lora.json", command, results, HERE, repo) is None
    # another memory size or OS is the same kind of machine; another CPU model, flag or core count not
    assert why_run("lora.json", command, results, {**HERE, "memory_gib": 64}, repo) is None
    avx2 = {**HERE, "cpu_flags": {"avx2": True, "avx512_bf16": False}}
    assert why_run("lora.json", command, results, avx2, repo) == (
        "lora.json ran on another kind of machine (cpu_flags differ)"
    )
    assert "cores differ" in (why_run("lora.json", command, results, {**HERE, "cores": 4}, repo) or "")
    # a partial run of the same benchmark is not the whole one
    assert "of another command" in (why_run("lora.json", ["bench.lora"], results, HERE, repo) or "")
    assert why_run("images.json", ["bench.images"], results, HERE, repo) == (
        "images.json has no result with provenance"
    )


def test_a_commit_to_what_it_measures_runs_it_again(tmp_path: Path) -> None:
    repo, rev = _repo(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    _result(results, "control_plane.json", rev, "python -m bench.dispatcher_sim", HERE, section="dispatcher")
    assert why_run("control_plane.json:dispatcher", ["bench.dispatcher_sim"], results, HERE, repo) is None
    assert why_run("control_plane.json:validation", ["bench.dispatcher_sim"], results, HERE, repo) == (
        "control_plane.json:validation has no result with provenance"
    )
    (repo / "measured" / "a.py").write_text("a = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "measured")
    assert why_run("control_plane.json:dispatcher", ["bench.dispatcher_sim"], results, HERE, repo) == (
        "control_plane.json:dispatcher is stale: 1 commits since touch measured"
    )


def test_the_command_line_skips_a_fresh_result_and_runs_a_stale_one(tmp_path: Path) -> None:
    """Through `python -m bench.resume` as make runs it: a fresh result (of this checkout's HEAD,
    measuring this very module, on this machine) is left alone and nothing runs; another command,
    or --force, runs the benchmark (here one that does not exist, so that its running shows)."""
    results = tmp_path / "results"
    results.mkdir()
    prov = {
        "command": "python -m bench.no_such_benchmark --rows 7",
        "code": {"revision": _git(REPO, "rev-parse", "HEAD").strip(), "dirty_measured": []},
        "measures": ["bench/resume.py"],
        "machine": machine_facts(),
    }
    (results / "tiny.json").write_text(json.dumps({"provenance": prov}))

    def resume(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "bench.resume", "--results", str(results), *args]
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)

    skipped = resume("tiny.json", "--", "bench.no_such_benchmark", "--rows", "7")
    assert skipped.returncode == 0, skipped.stderr
    assert "is fresh for `python -m bench.no_such_benchmark --rows 7`" in skipped.stdout
    for args, reason in (
        (("tiny.json", "--", "bench.no_such_benchmark", "--rows", "8"), "of another command"),
        (("--force", "tiny.json", "--", "bench.no_such_benchmark", "--rows", "7"), "(forced)"),
    ):
        ran = resume(*args)
        assert "running python -m bench.no_such_benchmark" in ran.stdout and reason in ran.stdout
        assert ran.returncode != 0 and "No module named bench.no_such_benchmark" in ran.stderr


def test_a_benchmark_that_wrote_its_result_but_missed_a_target_does_not_stop_make_bench(
    tmp_path: Path,
) -> None:
    """A benchmark exits 1 when a target of its is not met. Through `python -m bench.resume`, one
    that wrote its result (fresh: this revision, its command, this machine) exits 0 and names the
    targets it missed, so `make bench` goes on to the next; one that ends without writing (a crash)
    still fails."""
    results = tmp_path / "results"
    results.mkdir()
    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "missed_target_bench.py").write_text(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from bench.provenance import Run\n"
        "out, write = Path(sys.argv[1]), sys.argv[2] == 'write'\n"
        "prov = Run('missed_target_bench', ['bench/resume.py'])\n"
        "if write:\n"
        "    targets = {'speed': {'value': 0.8, 'bound': 0.95, 'pass': False},\n"
        "               'lost': {'value': 0, 'bound': 0, 'pass': True}}\n"
        "    out.write_text(json.dumps({'targets': targets, 'provenance': prov.finish()}))\n"
        "sys.exit(1)\n"
    )

    def resume(name: str, how: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "bench.resume", "--results", str(results), name, "--",
                "missed_target_bench", str(results / name), how]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{module_dir}{os.pathsep}{REPO}"}
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False, env=env)

    wrote = resume("missed.json", "write")
    assert wrote.returncode == 0, wrote.stdout + wrote.stderr
    assert "missed.json written; targets not met: speed" in wrote.stdout
    crashed = resume("crashed.json", "crash")
    assert crashed.returncode == 1 and not (results / "crashed.json").exists()
