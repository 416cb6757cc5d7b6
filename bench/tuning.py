"""Engine settings tuned per model (issue #51 part 4): Freight after ``freight models tune`` against
the bare engine at Freight's previous defaults and at vLLM's own offline defaults.

    python -m bench.tuning [--workloads unique,extract,shared_prefix,blend] [--scale 0.5] [--repeats 2]
                           [--requests 256] [--budget 420] [--out bench/results/tuning.json]

Per workload (``api.models_cli.SHAPES``: the generators ``freight models tune --shape`` samples):
  pilot            ``freight models tune demo --shape NAME --requests N`` against a Freight stack's
                   registry, exactly as an operator runs it (its own engine per grid point, the
                   previous defaults measured twice, n-gram speculation tried on the winner).
  limit_previous   vLLM's ``LLM.chat`` (bench/engine_baseline.py) on the lines sorted by prompt, at
                   Freight's previous defaults (64 sequences, 2,048 batched tokens, a 1 GiB KV
                   cache), stats logging off, the engine core inline (the faster placement here).
  limit_vllm       the same engine at vLLM's own offline defaults: no sequence, token or KV-cache
                   limit given, so vLLM chooses them for this device.
  freight_tuned    that stack's engine worker restarted (a worker applies its model's tuning when
                   it starts), warmed up again, then the file as written, end to end through the
                   Batch API.
Each engine runs an unmeasured warm-up file of the same shape and size (other prompts) first, and
every repeat uses fresh prompts (seed = the repeat). The figures are wall-time ratios on the same lines
(same output tokens): ``tuned_over_previous_limit`` = limit_previous's seconds over Freight's.

Targets (issue #51 part 4): tuned Freight >= 1.1x the limit at the previous defaults on at least
two workloads, and never below it (1.0x) on any.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.provenance import Run, machine_facts

REPO = Path(__file__).resolve().parent.parent
MEASURES = ("api", "scheduler", "storage", "workers", "bench/tuning.py", "bench/engine_baseline.py",
            "bench/freight_runner.py", "bench/limits.py")  # fmt: skip
WORKLOADS = ("unique", "extract", "shared_prefix", "blend")  # blend: long answers, where batch width pays
PREVIOUS = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_cache_bytes": 1 << 30}
MAX_MODEL_LEN = 2048
GAIN = 1.1  # tuned Freight over the limit at the previous defaults, on at least GAIN_WORKLOADS
GAIN_WORKLOADS = 2
FLOOR = 1.0  # and never below this on any workload
ENGINE_TIMEOUT_S = 1800
TUNE_TIMEOUT_S = 3600


def lines_of(name: str, tokenizer: Any, scale: float, seed: str) -> list[dict[str, Any]]:
    from api.models_cli import SHAPES

    function, _nominal = SHAPES[name]
    return list(getattr(wl, function)(tokenizer, scale, seed=seed))


def engine_run(
    model: Path, files: list[Path], warm: Path, out: Path, vllm_defaults: bool, dtype: str
) -> list[dict]:
    """One engine_baseline process for ``files`` (the warm-up file first, unmeasured)."""
    limits = ["--max-num-seqs", "0"] if vllm_defaults else [
        "--max-num-seqs", str(PREVIOUS["max_num_seqs"]),
        "--max-num-batched-tokens", str(PREVIOUS["max_num_batched_tokens"]),
        "--kv-cache-bytes", str(PREVIOUS["kv_cache_bytes"]),
    ]  # fmt: skip
    argv = [sys.executable, "-m", "bench.engine_baseline", "--out", str(out), "--core", "inline",
            "--no-stats-run", "--model", str(model), "--max-model-len", str(MAX_MODEL_LEN),
            "--dtype", dtype, *limits, "--warmup-file", str(warm), *map(str, files)]  # fmt: skip
    out.unlink(missing_ok=True)
    with open(out.with_suffix(".log"), "wb") as log:
        proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"engine baseline failed (exit {proc.returncode}): see {out.with_suffix('.log')}")
    data = json.loads(out.read_text())
    return [{**run, "engine_settings": data["settings"]} for run in data["runs"]]


def tune(stack: Any, name: str, requests: int, budget: float, log_path: Path) -> dict[str, Any]:
    """``freight models tune`` on the stack's registry, then what ``models list --json`` applies."""
    from bench.freight_runner import FREIGHT

    argv = [*FREIGHT, "models", "tune", "demo", "--shape", name, "--requests", str(requests),
            "--budget", str(budget)]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.run(argv, cwd=REPO, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=TUNE_TIMEOUT_S)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"freight models tune failed (exit {proc.returncode}): see {log_path}")
    listed = subprocess.run([*FREIGHT, "models", "list", "--json"], cwd=REPO, env=stack.env,
                            capture_output=True, text=True, check=True)  # fmt: skip
    for row in map(json.loads, listed.stdout.splitlines()):
        if row.get("name") == "demo":
            return row.get("tuned") or {}
    raise RuntimeError("the registry lists no model demo")


def freight_run(stack: Any, path: Path) -> dict[str, Any]:
    cell = stack.run_jobs([(wl.TENANTS[0], path)])
    if cell["errors"]:
        raise RuntimeError(f"Freight's run had errors: {json.dumps(cell)[:600]}")
    keep = ("wall_s", "requests", "prompt_tokens", "cached_tokens", "output_tokens", "phases_s", "cpu_s",
            "engine_steps", "batch_fill")  # fmt: skip
    return {k: cell.get(k) for k in keep}


def run_workload(name: str, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    from bench.freight_runner import FreightStack

    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = wl.load_tokenizer(args.model)
    files, sorted_files = [], []
    for r in range(args.repeats):
        lines = lines_of(name, tokenizer, args.scale, seed=f"tuning-{name}-r{r}")
        path = work / f"{name}-r{r}.jsonl"
        wl.write_jsonl(path, lines)
        files.append(path)
        sorted_path = work / f"{name}-r{r}.sorted.jsonl"
        wl.write_jsonl(sorted_path, wl.sort_by_prompt(tokenizer, lines)[0])
        sorted_files.append(sorted_path)
    warm = work / f"{name}-warm.jsonl"
    wl.write_jsonl(
        warm,
        wl.sort_by_prompt(tokenizer, lines_of(name, tokenizer, args.scale, f"tuning-{name}-warm"))[0],
    )
    print(f"[tuning] {name}: {len(lines)} lines a repeat", flush=True)

    limit_previous = engine_run(args.model, sorted_files, warm, work / "limit_previous.json", False, dtype)
    limit_vllm = engine_run(args.model, sorted_files, warm, work / "limit_vllm.json", True, dtype)
    # a fresh stack and registry each run: a tuning stored by the last run would start the worker
    # tuned, and be the pilot's "previous defaults"
    shutil.rmtree(work / "stack", ignore_errors=True)
    stack = FreightStack(
        work / "stack", args.model, max_num_seqs=PREVIOUS["max_num_seqs"], max_model_len=MAX_MODEL_LEN,
        tenants=wl.TENANTS, warmup_file=warm, extra_env={"FREIGHT_ENGINE_DTYPE": dtype},
    )  # fmt: skip
    stack.start()
    try:
        tuned = tune(stack, name, args.requests, args.budget, work / "tune.log")
        print(f"[tuning] {name}: tuned {json.dumps(tuned.get('engine_args'))}", flush=True)
        stack.stack.restart("engine-demo")
        stack.warm_up()
        freight = [freight_run(stack, path) for path in files]
    finally:
        stack.stop()
    ratios = [round(lp["wall_s"] / f["wall_s"], 4) for lp, f in zip(limit_previous, freight, strict=True)]
    vllm_ratios = [round(lv["wall_s"] / f["wall_s"], 4) for lv, f in zip(limit_vllm, freight, strict=True)]
    return {
        "lines": len(lines),
        "tuned": tuned,
        "limit_previous": limit_previous,
        "limit_vllm": limit_vllm,
        "freight_tuned": freight,
        "tuned_over_previous_limit": statistics.median(ratios),
        "tuned_over_vllm_limit": statistics.median(vllm_ratios),
        "vllm_limit_over_previous_limit": statistics.median(
            round(lp["wall_s"] / lv["wall_s"], 4) for lp, lv in zip(limit_previous, limit_vllm, strict=True)
        ),
        "repeats": {"tuned_over_previous_limit": ratios, "tuned_over_vllm_limit": vllm_ratios},
    }


def targets(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's two bounds over the workloads' median ratios."""
    gains = {name: cell["tuned_over_previous_limit"] for name, cell in results.items()}
    at_gain = sorted(gains.values(), reverse=True)
    nth = at_gain[GAIN_WORKLOADS - 1] if len(at_gain) >= GAIN_WORKLOADS else 0.0
    lowest = min(gains.values()) if gains else 0.0
    return {
        f"tuned_over_previous_limit_{GAIN_WORKLOADS}nd_best": {
            "value": nth, "bound": GAIN, "pass": nth >= GAIN,
        },
        "tuned_over_previous_limit_lowest": {"value": lowest, "bound": FLOOR, "pass": lowest >= FLOOR},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "bench")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--scale", type=float, default=0.5, help="of each shape's nominal size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256, help="the pilot's sample lines")
    parser.add_argument("--budget", type=float, default=420.0, help="the pilot's --budget (seconds)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "tuning.json")
    parser.add_argument("--work", type=Path, default=REPO / "var" / "bench" / "tuning")
    args = parser.parse_args(argv)

    from bench.scheduler import serving_dtype

    prov = Run("bench.tuning", MEASURES, argv)
    dtype = serving_dtype(args.model)
    names = [n for n in args.workloads.split(",") if n]
    results = {name: run_workload(name, args, dtype) for name in names}
    reached = targets(results)
    result: dict[str, Any] = {
        "benchmark": "tuning",
        "machine": machine_facts(),
        "model": str(args.model),
        "settings": {
            "scale": args.scale,
            "repeats": args.repeats,
            "pilot_requests": args.requests,
            "pilot_budget_s": args.budget,
            "previous_defaults": PREVIOUS,
            "dtype": dtype,
            "max_model_len": MAX_MODEL_LEN,
            "engine_core": "inline",
        },
        "workloads": results,
        "ratios": {
            name: {
                k: cell[k]
                for k in (
                    "tuned_over_previous_limit",
                    "tuned_over_vllm_limit",
                    "vllm_limit_over_previous_limit",
                )
            }
            for name, cell in results.items()
        },
        "targets": reached,
        "notes": "Wall-time ratios on the same lines (same output tokens), median over repeats. "
        "limit_previous and limit_vllm: vLLM's LLM.chat on the lines sorted by prompt (stats logging "
        "off, core inline), at Freight's previous defaults and at vLLM's own offline defaults. "
        "freight_tuned: Freight end to end (upload to the last result) after `freight models tune` "
        "on the workload's shape, the engine worker restarted to apply it.",
        "provenance": prov.finish(
            {f"{name}.{k}": v for name, cell in results.items() for k, v in cell["repeats"].items()}
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"ratios": result["ratios"], "targets": reached}, indent=1))
    return 0 if all(t["pass"] for t in reached.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
