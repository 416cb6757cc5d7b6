"""unique and multi_job, measured as paired runs: every system warm at once, one measured at a time.

The targets on these two workloads are ratios near 1 (Freight >= 0.95x the in-process engine;
20 batches >= 0.95x one batch), and on 2 cores one system's wall time drifts by 10-15% across a
run of the benchmark: measured in separate phases, the drift is as large as the effect. So the
systems are started and warmed together, then each repeat r gives all of them the same fresh
file (unique-r<r>.jsonl, prompts no system has seen):

  engine   the in-process engine (bench/engine_baseline.py --serve), LLM.chat on the file
  single   Freight stack A, the file as one batch
  multi    Freight stack B, the same lines as 20 batches from 3 tenants, tenants sharing one
           prefix cache (FREIGHT_PREFIX_CACHE_SHARING=global)
  multi_tenant  Freight stack C, the same 20 batches in Freight's default cache mode (tenant:
           each tenant's prefixes its own), so the isolation's cost is measured in the same run

while the others are paused (SIGSTOP, bench/freeze.py), in an order that rotates per repeat so
neither the first nor the last slot always falls to the same system. Each system has its own
engine, so no prefix cache sees a file twice. Warm-up: each system first runs the same
`unique-warmup.jsonl` (MAX_NUM_SEQS x 4 requests of the unique shape), which reaches the full batch
at full length, so every batch shape is compiled before the first measured run.

Reported per system: the median run (combine_repeats), and per repeat the paired ratios
single/engine, multi/single, multi_tenant/single and multi_tenant/multi (the isolation's cost,
tenant over global); the target ratios are the medians of those pairs.
"""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import workloads as wl

WARMUP_FILE = "unique-warmup.jsonl"
WARMUP_PER_SEQ = 4  # warm-up requests per engine slot


def warmup_file(work: Path, model_dir: Path, max_num_seqs: int) -> Path:
    path = work / WARMUP_FILE
    n = max_num_seqs * WARMUP_PER_SEQ
    if not path.exists() or sum(1 for _ in path.open()) != n:
        tokenizer = wl.load_tokenizer(model_dir)
        lines = wl.unique_lines(tokenizer, n / wl.UNIQUE_REQUESTS, seed=f"{wl.SEED}-warmup")
        wl.write_jsonl(path, lines)
    return path


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_interleaved(
    *,
    names: list[str],
    systems: list[str],
    unique_files: list[Path],
    warm: Path,
    kv_bytes: int | None,
    engine_argv: list[str],
    stack_factory: Callable[[str, Path], Any],
    run_dir: Path,
    with_rates: Callable[[dict[str, Any]], dict[str, Any]],
    combine: Callable[[list[dict[str, Any]]], dict[str, Any]],
    log: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[float]]], dict[str, Any]]:
    """({workload: {system: cell}}, {workload: {ratio: [per repeat]}}, freight settings)."""
    from bench.engine_baseline import EngineServer

    roles = []
    if "engine" in systems:
        roles.append("engine")
    if "freight" in systems:
        roles.append("single")
        if "multi_job" in names:
            roles.extend(("multi", "multi_tenant"))
    handles: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {role: [] for role in roles}
    errors: dict[str, str] = {}
    try:
        for role in roles:  # start each, then pause it while the next one starts
            log(f"interleaved: starting {role} ({'default' if kv_bytes is None else kv_bytes} KV)")
            try:
                if role == "engine":
                    handles[role] = EngineServer(
                        [*engine_argv, "--warmup-file", str(warm)], run_dir / "engine-serve.log"
                    )
                else:
                    handles[role] = stack_factory(role, warm).start()
                    settings[role] = handles[role].settings()
                handles[role].pause()
            except Exception as exc:
                traceback.print_exc()
                errors[role] = f"failed to start: {type(exc).__name__}: {exc}"[:2000]
        for r, path in enumerate(unique_files):
            order = roles[r % len(roles) :] + roles[: r % len(roles)]
            for role in order:
                if role in errors:
                    continue
                log(f"interleaved: repeat {r + 1}/{len(unique_files)}: {role} on {path.name}")
                handle = handles[role]
                handle.resume()
                try:
                    runs[role].append(with_rates(_measure(role, handle, path, run_dir / f"r{r}")))
                except Exception as exc:
                    traceback.print_exc()
                    runs[role].append({"error": f"{type(exc).__name__}: {exc}"[:2000]})
                finally:
                    handle.pause()
    finally:
        for handle in handles.values():
            handle.stop()

    cells = {role: ({"error": errors[role]} if role in errors else combine(runs[role])) for role in roles}
    paired = {
        "single_over_engine": _pairs(runs.get("single"), runs.get("engine")),
        "multi_over_single": _pairs(runs.get("multi"), runs.get("single")),
        "multi_over_engine": _pairs(runs.get("multi"), runs.get("engine")),
        "multi_tenant_over_single": _pairs(runs.get("multi_tenant"), runs.get("single")),
        "multi_tenant_over_multi": _pairs(runs.get("multi_tenant"), runs.get("multi")),
    }
    out: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    if "unique" in names:
        out["unique"] = {k: cells[v] for k, v in (("engine", "engine"), ("freight", "single")) if v in cells}
        ratios["unique"] = {"freight_over_engine": paired["single_over_engine"]}
    if "multi_job" in names:
        same = "the same lines in one file (unique), paired run by run"
        out["multi_job"] = {}
        if "engine" in cells:
            out["multi_job"]["engine"] = {**cells["engine"], "note": same}
        if "single" in cells:
            out["multi_job"]["freight_single_job"] = {
                **cells["single"],
                "note": "the same lines as one batch (unique) on a second warm stack, paired run by run",
            }
        if "multi" in cells:
            out["multi_job"]["freight"] = {**cells["multi"], "cache_sharing": "global"}
        if "multi_tenant" in cells:
            out["multi_job"]["freight_tenant"] = {
                **cells["multi_tenant"],
                "cache_sharing": "tenant",
                "note": "the same 20 batches in the default cache mode, on a third warm stack",
            }
        ratios["multi_job"] = {
            "freight_over_single_job": paired["multi_over_single"],
            "freight_over_engine": paired["multi_over_engine"],
            "freight_tenant_over_single_job": paired["multi_tenant_over_single"],
            "tenant_over_global": paired["multi_tenant_over_multi"],
        }
    return out, ratios, settings


def _measure(role: str, handle: Any, path: Path, run_dir: Path) -> dict[str, Any]:
    if role == "engine":
        run = dict(handle.run(path))
        run.pop("file", None)
        run["engine_settings"] = handle.facts.get("settings")
        return run
    if role == "single":
        return handle.run_jobs([(wl.TENANTS[0], path)])
    pieces = wl.split_multi_job(path, run_dir / "multi_job")
    return handle.run_jobs([(p["tenant"], Path(p["path"])) for p in pieces])


def _pairs(num: list[dict[str, Any]] | None, den: list[dict[str, Any]] | None) -> list[float]:
    """Per repeat: num's output rate over den's on the same file (skipping failed runs)."""
    if not num or not den:
        return []
    return [
        a["output_tok_s"] / b["output_tok_s"]
        for a, b in zip(num, den, strict=False)
        if "error" not in a and "error" not in b and b.get("output_tok_s")
    ]


def median_ratios(paired: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float | None]]:
    return {group: {k: _median(v) for k, v in fields.items()} for group, fields in paired.items()}
