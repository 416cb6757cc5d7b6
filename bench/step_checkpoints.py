"""A long benchmark's finished steps, kept so that a run cut short resumes where it stopped.

The scheduler benchmark (``bench/scheduler.py``) runs for longer than one sitting at a quiet
machine: every workload, both KV sizes, four systems, three repeats, the engine baselines on both
core placements. ``bench.resume`` makes ``make bench`` resumable one result file at a time, which
does not help a single benchmark longer than the sitting. So the benchmark runs each of its steps
(an engine process over a group's files, run_batch on one workload, a Freight stack over a group,
the paired runs) through :class:`StepCheckpoints`, which stores the step's output beside the
run's workloads, and a later run of the same benchmark takes a stored step instead of measuring it
again when, and only when, the step stands for this run:

- the code it measured is the code now: no commit since the step's revision touches what the
  benchmark measures, and none of that was dirty when it ran (``bench.provenance.staleness``);
- the same command (the benchmark's arguments exactly) and the same input files (their digest);
- the same kind of machine (``bench.resume.MACHINE_KIND``);
- the step finished without an error cell (a failed step is measured again).

A step's output goes through JSON whether it was measured or taken (what a resumed run computes
from it is what the uninterrupted run would have). Each step's times, revision and whether it was
taken from an earlier run go into the report's provenance (``record``), so a reader sees which
figures came from which sitting.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.provenance import REPO, code_state, dirty_measured, machine_facts, staleness, with_imports
from bench.resume import MACHINE_KIND


def inputs_digest(paths: Iterable[Path]) -> str:
    """sha256 over the files' names and contents, in name order: the run's inputs."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def has_error(payload: Any) -> bool:
    """Whether any mapping inside the payload holds an ``error`` key (a cell that failed)."""
    if isinstance(payload, Mapping):
        return "error" in payload or any(has_error(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return any(has_error(v) for v in payload)
    return False


class StepCheckpoints:
    """The steps of one benchmark run, stored in ``path`` (a JSON file beside its workloads).

    ``command`` is the benchmark's command line, ``measures`` the paths its provenance names,
    ``inputs`` the digest of its input files; ``checkout`` and ``machine`` are for tests."""

    def __init__(
        self,
        path: Path,
        command: str,
        measures: Sequence[str],
        inputs: str,
        *,
        checkout: Path = REPO,
        machine: Mapping[str, Any] | None = None,
        log: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.path = path
        self.command = command
        self.measures = with_imports(measures, checkout)
        self.inputs = inputs
        self.checkout = checkout
        here = machine if machine is not None else machine_facts()
        self.machine = {k: here.get(k) for k in MACHINE_KIND}
        self.log = log
        self.steps: dict[str, dict[str, Any]] = self._load()
        self.record: list[dict[str, Any]] = []  # this run's steps, in order: measured or taken

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            stored = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        steps = stored.get("steps") if isinstance(stored, dict) else None
        return steps if isinstance(steps, dict) else {}

    def why_not(self, step: Mapping[str, Any]) -> str | None:
        """Why a stored step does not stand for this run, or None when it does."""
        if step.get("command") != self.command:
            return "another command"
        if step.get("inputs") != self.inputs:
            return "other input files"
        if step.get("machine") != self.machine:
            return "another kind of machine"
        fresh = staleness(
            {"code": step.get("code") or {}, "measures": self.measures}, self.checkout, expanded=True
        )
        if fresh != "fresh":
            return fresh
        if has_error(step.get("output")):
            return "it failed"
        return None

    def run(self, name: str, measure: Callable[[], Any]) -> Any:
        """The step's output: the stored one if it stands for this run, else ``measure()``'s, stored."""
        stored = self.steps.get(name)
        if stored is not None and (why := self.why_not(stored)) is None:
            self.log(
                f"step {name}: taken from the run of {stored['started_at']} ({stored['code']['revision'][:12]})"
            )
            self.record.append({"step": name, "taken": True, **_times(stored)})
            return stored["output"]
        if stored is not None:
            self.log(f"step {name}: measured again ({why})")
        code = code_state(self.checkout)
        started_at, began = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
        output = json.loads(json.dumps(measure(), default=str))
        step = {
            "command": self.command,
            "inputs": self.inputs,
            "machine": self.machine,
            "code": {"revision": code["revision"], "dirty_measured": dirty_measured(code, self.measures)},
            "started_at": started_at,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "duration_s": round(time.monotonic() - began, 1),
            "output": output,
        }
        self.steps[name] = step
        self._save()
        self.record.append({"step": name, "taken": False, **_times(step)})
        return output

    def _save(self) -> None:
        """Written whole to a temporary file, then renamed: a run killed mid-write loses no step."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"steps": self.steps}, indent=1) + "\n")
        os.replace(tmp, self.path)


def _times(step: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "revision": (step.get("code") or {}).get("revision"),
        "started_at": step.get("started_at"),
        "finished_at": step.get("finished_at"),
        "duration_s": step.get("duration_s"),
    }
