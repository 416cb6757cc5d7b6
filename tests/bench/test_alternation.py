"""bench/alternation.py: the limit and Freight turn about (pure logic; the systems are fakes that
record what they were asked, the engine and stack themselves run in the benchmark)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import alternation
from bench.scheduler import repeat_of


class Fake:
    """A system that records its calls in a shared log and answers a run with its wall time."""

    def __init__(self, name: str, log: list[tuple[str, str]], running: set[str], fail: bool = False) -> None:
        self.name, self.log, self.running, self.fail = name, log, running, fail
        self.facts = {"engine_startup_s": 1.0, "settings": {"engine_core": name}}
        running.add(name)

    def start(self) -> Fake:
        return self

    def settings(self) -> dict[str, Any]:
        return {"stack": self.name}

    def pause(self) -> None:
        self.running.discard(self.name)

    def resume(self) -> None:
        self.running.add(self.name)

    def stop(self) -> None:
        self.log.append((self.name, "stop"))

    def _measure(self, what: str) -> dict[str, Any]:
        assert self.running == {self.name}, f"{self.name} measured beside {self.running - {self.name}}"
        self.log.append((self.name, what))
        if self.fail:
            raise RuntimeError("engine died")
        return {"file": what, "wall_s": 2.0, "output_tokens": 100}

    def run(self, path: Path) -> dict[str, Any]:
        return self._measure(path.name)

    def run_jobs(self, jobs: list[tuple[str, Path]]) -> dict[str, Any]:
        return self._measure("+".join(f"{tenant}:{path.name}" for tenant, path in jobs))


def files(tmp_path: Path, names: list[str], repeats: int) -> tuple[dict[str, Path], dict[str, list[Path]]]:
    engine = {
        f"{name}{suffix}#r{r}": tmp_path / f"{name}-r{r}{suffix or '-as-written'}.jsonl"
        for name in names
        for r in range(repeats)
        for suffix in ("", "+sorted")
    }
    freight = {
        name: [*(tmp_path / f"{name}-r{r}.jsonl" for r in range(repeats)), tmp_path / f"{name}-warm.jsonl"]
        for name in names
    }
    return engine, freight


def run(
    tmp_path: Path,
    fail: str = "",
    start_fails: str = "",
    roles: Callable[[list[tuple[str, str]], set[str]], dict[str, Any]] | None = None,
) -> tuple[Any, list[tuple[str, str]]]:
    """run_alternating on dups and blend (2 repeats each), both placements and ``roles`` (made on
    the shared log and running set; default: one stack, each file one batch of tenant-a)."""
    log: list[tuple[str, str]] = []
    running: set[str] = set()
    engine, freight = files(tmp_path, ["dups", "blend"], 2)

    def engine_server(core: str, warm: tuple[Path, ...]) -> Fake:
        if core == start_fails:
            raise RuntimeError("no engine")
        log.append((f"engine:{core}", "start " + ",".join(p.name for p in warm)))
        return Fake(f"engine:{core}", log, running, fail=core == fail)

    out = alternation.run_alternating(
        names=["dups", "blend"],
        engine_files=engine,
        engine_warmups=(tmp_path / "dups-warm.jsonl", tmp_path / "blend-warm.jsonl"),
        freight_files=freight,
        placements=("inline", "process"),
        engine_server=engine_server,
        roles=roles(log, running)
        if roles is not None
        else {
            "freight": alternation.FreightRole(
                lambda: Fake("freight", log, running), alternation.one_batch("tenant-a")
            )
        },
        repeat_of=repeat_of,
        with_rates=lambda cell: {**cell, "output_tok_s": cell["output_tokens"] / cell["wall_s"]},
        log=lambda message: None,
    )
    return out, log


def test_each_repeat_runs_every_system_alone_in_a_rotating_order(tmp_path: Path) -> None:
    (by_core, runs, settings), log = run(tmp_path)
    freight = runs["freight"]
    measured = [
        (who, what.removeprefix("tenant-a:"))
        for who, what in log
        if what != "stop" and not what.startswith("start")
    ]
    # Freight warms on each workload's warm-up file before any measured run
    assert measured[:2] == [("freight", "dups-warm.jsonl"), ("freight", "blend-warm.jsonl")]
    turns = [measured[2 + 5 * t : 2 + 5 * (t + 1)] for t in range(4)]  # 2 + 2 engine runs + 1 Freight
    systems = [list(dict.fromkeys(who for who, _ in turn)) for turn in turns]
    assert systems == [
        ["engine:inline", "engine:process", "freight"],
        ["engine:process", "freight", "engine:inline"],
        ["freight", "engine:inline", "engine:process"],
        ["engine:inline", "engine:process", "freight"],
    ]
    # each turn is one workload's one repeat, for every system
    assert {what for _, what in turns[1]} == {
        "dups-r1-as-written.jsonl",
        "dups-r1+sorted.jsonl",
        "dups-r1.jsonl",
    }
    assert {what for _, what in turns[2]} == {
        "blend-r0-as-written.jsonl",
        "blend-r0+sorted.jsonl",
        "blend-r0.jsonl",
    }
    assert set(by_core["inline"]) == set(by_core["process"]) == set(files(tmp_path, ["dups", "blend"], 2)[0])
    cell = by_core["process"]["blend+sorted#r1"]
    assert cell["output_tok_s"] == 50.0 and "file" not in cell
    assert cell["engine_settings"] == {"engine_core": "engine:process"} and cell["engine_startup_s"] == 1.0
    assert [r["file"] for r in freight["dups"]] == ["tenant-a:dups-r0.jsonl", "tenant-a:dups-r1.jsonl"]
    assert settings == {"freight": {"stack": "freight"}}
    assert sorted(who for who, what in log if what == "stop") == [
        "engine:inline",
        "engine:process",
        "freight",
    ]


def test_a_failing_system_gets_error_cells_and_the_others_are_measured(tmp_path: Path) -> None:
    (by_core, runs, _), _ = run(tmp_path, fail="inline")
    assert all("engine died" in cell["error"] for cell in by_core["inline"].values())
    assert all(cell["output_tok_s"] == 50.0 for cell in by_core["process"].values())
    assert len(runs["freight"]["blend"]) == 2


def test_a_system_that_does_not_start_is_an_error_in_each_of_its_cells(tmp_path: Path) -> None:
    (by_core, runs, _), _ = run(tmp_path, start_fails="process")
    assert len(by_core["process"]) == 8
    assert all(
        cell["error"].startswith("failed to start: RuntimeError: no engine")
        for cell in by_core["process"].values()
    )
    assert all("error" not in cell for cell in by_core["inline"].values())
    assert all("error" not in r for r in runs["freight"]["dups"])


def test_several_freight_modes_each_run_every_repeat_in_their_own_jobs(tmp_path: Path) -> None:
    """multi_job_shared_prefix's modes: each role a stack of its own in the rotation, warmed and
    measured on its own jobs of the same file, alone."""

    def split(_name: str, path: Path) -> list[tuple[str, Path]]:
        return [(tenant, path.with_name(f"{path.stem}-{tenant}.jsonl")) for tenant in ("t1", "t2")]

    def roles(log: list[tuple[str, str]], running: set[str]) -> dict[str, Any]:
        return {
            "single": alternation.FreightRole(
                lambda: Fake("single", log, running), alternation.one_batch("t1")
            ),
            "split": alternation.FreightRole(lambda: Fake("split", log, running), split),
        }

    (_, runs, settings), log = run(tmp_path, roles=roles)
    assert set(runs) == set(settings) == {"single", "split"}
    assert [r["file"] for r in runs["single"]["dups"]] == ["t1:dups-r0.jsonl", "t1:dups-r1.jsonl"]
    assert [r["file"] for r in runs["split"]["blend"]] == [
        "t1:blend-r0-t1.jsonl+t2:blend-r0-t2.jsonl",
        "t1:blend-r1-t1.jsonl+t2:blend-r1-t2.jsonl",
    ]
    warm = [what for who, what in log if who == "split"][:2]
    assert warm == [
        "t1:dups-warm-t1.jsonl+t2:dups-warm-t2.jsonl",
        "t1:blend-warm-t1.jsonl+t2:blend-warm-t2.jsonl",
    ]
    # four systems rotate, each turn one further along (a turn: 2 runs per engine, 1 per stack)
    measured = [
        who for who, what in log if what != "stop" and not what.startswith("start") and "warm" not in what
    ]
    orders = [list(dict.fromkeys(measured[6 * t : 6 * (t + 1)])) for t in range(4)]
    assert orders == [
        ["engine:inline", "engine:process", "single", "split"],
        ["engine:process", "single", "split", "engine:inline"],
        ["single", "split", "engine:inline", "engine:process"],
        ["split", "engine:inline", "engine:process", "single"],
    ]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("dups#r0", ("dups", 0)),
        ("dups+sorted#r2", ("dups", 2)),
        ("multi_job_shared_prefix+tenant-sorted#r1", ("multi_job_shared_prefix", 1)),
    ],
)
def test_repeat_of_names_the_workload_and_repeat_of_an_engine_key(
    key: str, expected: tuple[str, int]
) -> None:
    assert repeat_of(key) == expected
