"""The limit and Freight measured turn about, repeat by repeat (issue #51 part 1).

Measured in phases (an engine process over every repeat of a group of workloads, then a Freight
stack over the same), a ratio near 1 judges the machine as much as Freight: on the 2-core hosts one
system's wall time moved 10-25% between phases minutes apart (bench/README, "Run again"), while
three engine processes kept warm side by side and run in turn stayed within about 5% of one another
over ten minutes. So for the workloads measured against the limit, every system is started and
warmed first (each engine placement with its warm-up files, the Freight stack on each workload's
warm-up file), then for each workload and repeat each system runs its file(s) of that repeat while
the others are paused (SIGSTOP, bench/freeze.py), in an order that rotates by one every turn so
neither end of a turn always falls to the same system. Each system keeps its own engine and prefix
cache (reset by the engine baseline before each file; a Freight file's prompts are new to its
stack), so no system sees another's lines.

An engine system's turn runs every variant of the repeat (the lines as written, sorted, sorted by
tenant) one after another, each measured as bench/engine_baseline.py measures a file, then its
unmeasured stats run for fill and steps. Freight may be several systems of the rotation
(``FreightRole``): multi_job_shared_prefix's four modes (one job or six, global or per-tenant
caches) are four warm stacks, each submitting a repeat's lines as its mode's jobs. The output is
the engine's cells by key per placement and each role's runs per workload, so each ratio is repeat
r of Freight over repeat r of the limit (or of another mode), all of them run within a few
minutes of each other.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def turns(
    names: list[str],
    engine_files: dict[str, Path],
    freight_files: dict[str, list[Path]],
    repeat_of: Callable[[str], tuple[str, int]],
) -> list[tuple[str, int, list[str], Path | None]]:
    """[(workload, repeat, engine keys of that repeat, Freight's file or None)] in run order:
    workload by workload, repeat by repeat. ``freight_files[name]`` is the repeats, then the warm-up
    (the last); ``repeat_of`` maps an engine key to (workload, repeat)."""
    keys: dict[tuple[str, int], list[str]] = {}
    for key in engine_files:
        keys.setdefault(repeat_of(key), []).append(key)
    out = []
    for name in names:
        repeats = {r for n, r in keys if n == name} | set(range(len(freight_files.get(name, [])[:-1])))
        for r in sorted(repeats):
            paths = freight_files.get(name, [])[:-1]
            out.append((name, r, keys.get((name, r), []), paths[r] if r < len(paths) else None))
    return out


def rotation(systems: list[str], turn: int) -> list[str]:
    """The systems' order in turn ``turn``: rotated by one each turn."""
    k = turn % len(systems) if systems else 0
    return systems[k:] + systems[:k]


@dataclass(frozen=True)
class FreightRole:
    """One warm Freight stack of a turn-about run: ``factory()`` an unstarted FreightStack, and
    ``jobs(workload, file)`` the batches it submits together for that file (its repeat or its
    warm-up) as [(tenant, file)]: the file itself as one batch, or its lines split into jobs of
    several tenants (multi_job_shared_prefix's modes)."""

    factory: Callable[[], Any]
    jobs: Callable[[str, Path], list[tuple[str, Path]]]


def one_batch(tenant: str) -> Callable[[str, Path], list[tuple[str, Path]]]:
    """A role's jobs: each file as one batch of ``tenant``."""
    return lambda _name, path: [(tenant, path)]


def run_alternating(
    *,
    names: list[str],
    engine_files: dict[str, Path],
    engine_warmups: tuple[Path, ...],
    freight_files: dict[str, list[Path]],
    placements: tuple[str, ...],
    engine_server: Callable[[str, tuple[Path, ...]], Any],
    roles: dict[str, FreightRole],
    repeat_of: Callable[[str], tuple[str, int]],
    with_rates: Callable[[dict[str, Any]], dict[str, Any]],
    log: Callable[[str], None],
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, list[dict[str, Any]]]], dict[str, Any]]:
    """({placement: {engine key: cell}}, {role: {workload: [Freight's run per repeat]}},
    {role: its stack's settings}).

    ``engine_server(placement, warmups)`` starts a warm bench.engine_baseline server (EngineServer)
    on that core placement; each of ``roles`` is a warm Freight stack taking every workload's files
    in its own way (none: no Freight). Every engine placement and every role is one system of the
    rotation. A system that fails to start gets an error cell for each of its runs; the others go
    on."""
    handles: dict[str, Any] = {}
    errors: dict[str, str] = {}
    settings: dict[str, Any] = {}
    systems = [f"engine:{p}" for p in placements] + list(roles)
    by_core: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in placements}
    freight_runs: dict[str, dict[str, list[dict[str, Any]]]] = {role: {} for role in roles}
    try:
        for system in systems:  # start each, warm it, then pause it while the next one starts
            log(f"alternating: starting {system}")
            try:
                if system in roles:
                    handle = handles[system] = roles[system].factory().start()
                    settings[system] = handle.settings()
                    for name in names:
                        if name in freight_files:
                            log(f"alternating: {system} warm-up on {freight_files[name][-1].name}")
                            handle.run_jobs(roles[system].jobs(name, freight_files[name][-1]))
                else:
                    handles[system] = engine_server(system.removeprefix("engine:"), engine_warmups)
                handles[system].pause()
            except Exception as exc:
                traceback.print_exc()
                errors[system] = f"failed to start: {type(exc).__name__}: {exc}"[:2000]
        for turn, (name, r, keys, freight_path) in enumerate(
            turns(names, engine_files, freight_files, repeat_of)
        ):
            for system in rotation(systems, turn):
                if (system in roles and freight_path is None) or (system not in roles and not keys):
                    continue
                log(f"alternating: {name} repeat {r}: {system}")
                handle, error = handles.get(system), errors.get(system)
                if system in roles:
                    assert freight_path is not None
                    jobs = roles[system].jobs(name, freight_path)
                    run = _turn(handle, error, _freight_run, jobs, with_rates)
                    freight_runs[system].setdefault(name, []).append(run)
                    continue
                core = system.removeprefix("engine:")
                for key in keys:
                    by_core[core][key] = _turn(handle, error, _engine_run, engine_files[key], with_rates)
    finally:
        for handle in handles.values():
            try:
                handle.stop()
            except Exception:
                traceback.print_exc()
    return by_core, freight_runs, settings


def _turn(
    handle: Any,
    error: str | None,
    measure: Callable[[Any, Any], dict[str, Any]],
    what: Any,
    with_rates: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """One measured run with its system resumed, paused again after; an error cell if it fails."""
    if handle is None:
        return {"error": error or "not started"}
    handle.resume()
    try:
        return with_rates(measure(handle, what))
    except Exception as exc:
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        handle.pause()


def _freight_run(handle: Any, jobs: list[tuple[str, Path]]) -> dict[str, Any]:
    """A Freight stack's run of one file's batches, submitted together."""
    result: dict[str, Any] = handle.run_jobs(jobs)
    return result


def _engine_run(handle: Any, path: Path) -> dict[str, Any]:
    """An engine server's run of one file in the engine baseline's cell shape (the file's key dropped)."""
    run = dict(handle.run(path))
    run.pop("file", None)
    run["engine_startup_s"] = handle.facts.get("engine_startup_s")
    run["engine_settings"] = handle.facts.get("settings")
    return run
