"""bench/step_checkpoints.py: a long benchmark cut short resumes at its first step that does not
stand, and only a step measured on this code, command, inputs and kind of machine stands."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.step_checkpoints import StepCheckpoints, has_error, inputs_digest
from tests.bench.test_bench_resume import HERE, _git, _repo

COMMAND = "python -m bench.scheduler"


def _counting(output: Any) -> tuple[Callable[[], Any], list[int]]:
    calls: list[int] = []

    def measure() -> Any:
        calls.append(1)
        return output

    return measure, calls


def _steps(repo: Path, path: Path, **changes: Any) -> StepCheckpoints:
    kwargs: dict[str, Any] = {"command": COMMAND, "inputs": "digest-1", "machine": HERE, **changes}
    return StepCheckpoints(
        path, kwargs["command"], ["measured"], kwargs["inputs"], checkout=repo, machine=kwargs["machine"]
    )


def test_a_step_measured_once_is_taken_by_the_next_run(tmp_path: Path) -> None:
    repo, rev = _repo(tmp_path)
    path = tmp_path / "steps.json"
    first = _steps(repo, path)
    measure, calls = _counting({"unique": {"wall_s": 1.5, "file": tmp_path / "x.jsonl"}, "pair": (1, 2)})
    out = first.run("engine:default:1:inline", measure)
    # what the measuring run goes on with is what a resumed one will take: JSON's form
    assert out == {"unique": {"wall_s": 1.5, "file": str(tmp_path / "x.jsonl")}, "pair": [1, 2]}
    assert calls == [1] and first.record[0]["taken"] is False and first.record[0]["revision"] == rev

    second = _steps(repo, path)
    again, again_calls = _counting({"unique": {"wall_s": 9.9}})
    assert second.run("engine:default:1:inline", again) == out
    assert again_calls == []
    assert second.record == [{**first.record[0], "taken": True}]
    # a step the first run did not reach is measured
    other, other_calls = _counting([3])
    assert second.run("runbatch:default:1:unique", other) == [3] and other_calls == [1]
    stored = json.loads(path.read_text())["steps"]
    assert sorted(stored) == ["engine:default:1:inline", "runbatch:default:1:unique"]


def test_a_commit_to_what_the_benchmark_measures_makes_every_step_measured_again(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    path = tmp_path / "steps.json"
    _steps(repo, path).run("s", lambda: {"v": 1})

    (repo / "README").write_text("elsewhere\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "docs")
    measure, calls = _counting({"v": 2})
    assert _steps(repo, path).run("s", measure) == {"v": 1} and calls == []  # a commit elsewhere

    (repo / "measured" / "a.py").write_text("a = 2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "code")
    steps = _steps(repo, path)
    assert steps.why_not(steps.steps["s"]) == "stale: 1 commits since touch measured"
    assert steps.run("s", measure) == {"v": 2} and calls == [1]
    assert steps.record[0]["taken"] is False


def test_a_step_measured_on_uncommitted_code_is_never_taken(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    path = tmp_path / "steps.json"
    (repo / "measured" / "a.py").write_text("a = 'being edited'\n")
    _steps(repo, path).run("s", lambda: {"v": 1})
    steps = _steps(repo, path)
    assert steps.why_not(steps.steps["s"]) == "stale: run on uncommitted changes to measured/a.py"


def test_another_command_other_inputs_or_another_machine_kind_measure_again(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    path = tmp_path / "steps.json"
    _steps(repo, path).run("s", lambda: {"v": 1})
    cases = {
        "another command": {"command": COMMAND + " --quick"},
        "other input files": {"inputs": "digest-2"},
        "another kind of machine": {"machine": {**HERE, "cores": 4}},
    }
    for why, changes in cases.items():
        steps = _steps(repo, path, **changes)
        assert steps.why_not(steps.steps["s"]) == why
        measure, calls = _counting({"v": 2})
        assert steps.run("s", measure) == {"v": 2} and calls == [1]
        _steps(repo, path).run("s", lambda: {"v": 1})  # the original key's step again for the next case


def test_a_step_with_a_failed_cell_is_measured_again(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    path = tmp_path / "steps.json"
    _steps(repo, path).run("s", lambda: [{"unique": {"error": "exit 1: killed"}}, {}])
    measure, calls = _counting([{"unique": {"wall_s": 2.0}}, {}])
    steps = _steps(repo, path)
    assert steps.why_not(steps.steps["s"]) == "it failed"
    assert steps.run("s", measure) == [{"unique": {"wall_s": 2.0}}, {}] and calls == [1]
    assert has_error({"a": [{"b": {"error": "x"}}]}) and not has_error({"a": [{"b": 1}], "errors": 0})


def test_a_torn_or_missing_file_holds_no_step(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path)
    path = tmp_path / "steps.json"
    path.write_text('{"steps": {"s": ')  # killed mid-write by an older writer
    measure, calls = _counting({"v": 1})
    assert _steps(repo, path).run("s", measure) == {"v": 1} and calls == [1]
    assert not (tmp_path / "steps.json.tmp").exists()  # written whole, then renamed
    assert _steps(repo, tmp_path / "none.json").steps == {}


def test_the_inputs_digest_follows_names_and_contents(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("one\n")
    (tmp_path / "b.jsonl").write_text("two\n")
    files = [tmp_path / "b.jsonl", tmp_path / "a.jsonl"]
    digest = inputs_digest(files)
    assert digest == inputs_digest(reversed(files))
    (tmp_path / "b.jsonl").write_text("two!\n")
    assert inputs_digest(files) != digest
