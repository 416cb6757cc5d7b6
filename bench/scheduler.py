"""The scheduler benchmark (issues #3, #24, #51): four systems, nine workloads, two KV cache sizes.

    python -m bench.scheduler [--quick] [--eager] [--out PATH] [--work DIR] [--model DIR]
                              [--workloads unique,shared_prefix,system_prompts,multi_job,
                                           multi_job_shared_prefix,blend,long_prefix,dups,request_rate]
                              [--kv default,tight] [--systems engine,engine_sorted,runbatch,freight]
                              [--repeats N]

Systems, all at the same limits (max_num_seqs, max_num_batched_tokens, max_model_len, KV cache,
prefix caching on, compiled unless --eager, VLLM_CPU_NUM_OF_RESERVED_CPU=0):
  engine    (a) vLLM `LLM.chat` in-process on the lines in file order; engine start-up excluded
            (bench/engine_baseline.py), prefix cache reset between files; stats logging off, on
            the faster core placement per file (--engine-core faster: inline and process both
            run), warmed on each workload's shape with other prompts; fill and steps from a
            second, unmeasured run.
  engine_sorted  the same engine on the same lines sorted by rendered prompt token ids (the chat
            template applied by the tokenizer), in SORTED_WORKLOADS: there, the limit (issue #51;
            bench/against_limit.py); for multi_job_shared_prefix also engine_sorted_tenant, the
            lines sorted by tenant, then prompt, with their tenant's cache_salt (tenant mode's).
  runbatch  (b) `python -m vllm.entrypoints.openai.run_batch` on the same file, whole process
            (bench/runbatch_baseline.py).
  freight   (c) Freight end to end through the Batch API with the `openai` client, from the first
            upload to the last output file, on a stack already warm (bench/freight_runner.py).

Workloads (bench/workloads.py, fixed seeds): unique, shared_prefix, system_prompts,
multi_job = the unique lines as 20 batches of 3 tenants submitted together (in both cache modes), and
multi_job_shared_prefix = 40 few-shot prompts x 30 items, which Freight runs in four modes
(run_multi_job_shared_prefix): as one job; as 3 tenants x 2 jobs (global cache sharing); the same
jobs with FREIGHT_PREFIX_CACHE_SHARING=tenant; and one job per tenant with tenant sharing. The
plan's ideal cache hit rate (bench/prefix.py) is that of the lines prefix-sorted as one job.
Issue #51's: blend, long_prefix, dups (20% exact duplicates) and request_rate (bench/workloads.py).

The rest (shared_prefix, system_prompts, issue #51's): turn about (bench/alternation.py): per KV
size, the engine on each core placement and one Freight stack are started and warmed on each
workload's warm-up file (unmeasured), then for each workload and each of its --repeats files
(other prompts each) every system runs that repeat while the others are paused, in a rotating
order; the cell is the median run and Freight over the limit the median of the per-repeat ratios,
each pair measured within a minute or so. multi_job_shared_prefix the same way in a rotation of its
own: its engine variants (as written, sorted, sorted by tenant) on each placement and its four
Freight modes, each a warm stack. unique and multi_job (targets near 1, where the machine's drift
matters): paired
runs (bench/interleaved.py): the engine and two Freight stacks (one batch; 20 batches) are warm at
once, each repeat gives all three the same fresh file while the other two are paused, and the
target ratios are the medians of the per-repeat ratios.

Cache modes (FREIGHT_PREFIX_CACHE_SHARING): Freight's default, tenant, unless a cell says global.
A workload of one tenant has the same cache hits in both. The multi-tenant workloads run both side
by side in the same run: multi_job's 20 batches on a global stack (cell freight) and on a tenant
one (freight_tenant), multi_job_shared_prefix's 3 tenants x 2 jobs as freight (global) and
freight_per_tenant (tenant); the isolation's cost is ratios.<group>.tenant_over_global (tenant's
output rate over global's, per repeat, median), and the default mode has its own targets
(multi_job.freight_tenant_over_single_job; the per-tenant ratio of multi_job_shared_prefix).

KV sizes: "default" = Freight's default FREIGHT_ENGINE_KV_CACHE_GIB; "tight" = per workload,
max_num_seqs x blocks per request (longest prompt + output, in --block-size blocks) x TIGHT_FACTOR,
so the running batch fits and little else: which prefixes stay cached is decided by order. For
multi_job_shared_prefix, whose 64 running requests share a few prompts, "tight" holds
PREFIX_TIGHT_SHARE of its shared prefix tokens (16k of 32k): a batch and a few prompts.

Writes bench/results/scheduler.json (--quick: scheduler-quick.json, every workload 10x smaller)
and prints a table. A system that fails gets {"error": ...} in its cell; the rest goes on.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.against_limit import CPU_NOTE, engine_cpu, limit_ratio_lists, limit_targets, spread
from bench.provenance import STACK, Run, machine_facts
from bench.step_checkpoints import StepCheckpoints, inputs_digest

REPO = Path(__file__).resolve().parent.parent
# The benchmark model: the demo model's tokenizer and architecture, 4x its per-token compute
# (hidden 512, MLP 1536; 12M non-embedding parameters), built by `make bench-model`. On 2 CPU
# cores the 5M-parameter demo model spends as much time in per-step overhead as in its layers;
# this one is still small enough for a full run in under an hour. `--model models/demo` runs the
# same benchmark on the demo model.
MODEL_DIR = Path("models/bench")
RESULTS_DIR = REPO / "bench" / "results"
WORK_DIR = REPO / "var" / "bench"

MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 2048
MAX_NUM_BATCHED_TOKENS = 2048  # what Freight's engine gets (vLLM's LLMEngine default on CPU); set on (a), (b)
# KV block for every system (vLLM's CPU default is 128; its kernel takes any multiple of 32). Only
# whole blocks are shared, so a 1,000-token document is 992 cacheable tokens at 32, 896 at 128.
BLOCK_SIZE = 32
TIGHT_FACTOR = 1.05  # 5% headroom over the running batch: about three spare documents of shared_prefix
QUICK_SCALE = 0.1
MJSP = "multi_job_shared_prefix"
LIMIT_WORKLOADS = ("blend", "long_prefix", "dups", "request_rate")  # issue #51's (bench/workloads.py)
WORKLOADS = ("unique", "shared_prefix", "system_prompts", "multi_job", MJSP, *LIMIT_WORKLOADS)
PREFIX_WORKLOADS = ("shared_prefix", "system_prompts", MJSP)
KV_REPORT_WORKLOADS = (*PREFIX_WORKLOADS, "blend", "long_prefix")  # prefix workloads: KV admission's report
SORTED_WORKLOADS = (*PREFIX_WORKLOADS, *LIMIT_WORKLOADS)  # where engine_sorted runs: their limit
KV_CONFIGS = ("default", "tight")
SYSTEMS = ("engine", "engine_sorted", "runbatch", "freight")
SORTED = "+sorted"  # an engine key of a workload's sorted file
TENANT_SORTED = "+tenant-sorted"  # ... of its lines sorted by tenant, then prompt, salted by tenant
REPEAT = "#r"  # an engine key of repeat r: NAME[+sorted]#rN
# multi_job_shared_prefix's tight KV cache: this share of its shared prefix tokens (all 40 prompts)
PREFIX_TIGHT_SHARE = 0.5

TARGETS = {  # ratio key -> (">=" or "<=", bound)
    "unique.freight_over_engine": (">=", 0.95),
    "shared_prefix_tight_kv.freight_over_engine": (">=", 2.5),
    "shared_prefix_tight_kv.freight_over_runbatch": (">=", 2.5),
    "multi_job.freight_over_single_job": (">=", 0.95),
    "multi_job.freight_tenant_over_single_job": (">=", 0.95),  # the same in the default cache mode
    "shared_prefix_tight_kv.freight_over_engine_sorted": (">=", 0.9),
    f"{MJSP}_tight_kv.freight_over_single_job": (">=", 0.95),
    f"{MJSP}_tight_kv.hit_rate_gap_points": ("<=", 2.0),
    f"{MJSP}_tight_kv.per_tenant_over_single_job_per_tenant": (">=", 0.95),
    f"{MJSP}_tight_kv.freight_over_engine_sorted": (">=", 0.9),
    f"{MJSP}_tight_kv.multi_job_over_engine_sorted": (">=", 0.9),
    # issue #51: Freight against the limit on every workload and mode (bench/against_limit.py)
    **limit_targets(WORKLOADS, KV_CONFIGS),
    # issue #51 part 6, KV-aware admission at tight KV, the worst repeat: vLLM never preempts, and
    # the prefix cache serves within a point of the plan (bench/freight_runner.engine_samples_kv)
    **{f"{name}_tight_kv.preemptions": ("<=", 0) for name in KV_REPORT_WORKLOADS},
    **{f"{name}_tight_kv.kv_plan_gap_points": ("<=", 1.0) for name in KV_REPORT_WORKLOADS},
}


# what a scheduler result measures: the stack, the systems it is compared with, the workloads
MEASURES = (
    *STACK,
    "bench/scheduler.py",
    "bench/freight_runner.py",
    "bench/interleaved.py",
    "bench/workloads.py",
    "bench/engine_baseline.py",
    "bench/runbatch_baseline.py",
    "bench/against_limit.py",
)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """A benchmark's result file (bench/results/*.json), its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------------------- facts


def safetensors_parameters(model_dir: Path) -> int | None:
    total = 0
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"])
    return total or None


@functools.lru_cache
def serving_dtype(model_dir: Path) -> str:
    """The dtype every system serves ``model_dir`` in: Freight's own choice on this machine
    (``workers.engine.serving_dtype``, float32 on a CPU without native BF16), passed explicitly
    to the engine baseline and run_batch too, which would otherwise run BF16 there."""
    from workers.checkpoint import stored_dtype
    from workers.engine import native_half_precision
    from workers.engine import serving_dtype as choose

    stored, quantized = stored_dtype(model_dir)
    chosen = choose("auto", stored, quantized, native_half=native_half_precision())
    return (stored or "bfloat16") if chosen == "auto" else chosen


def model_facts(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype_bytes = {"float32": 4, "float": 4}.get(serving_dtype(model_dir), 2)
    kv_bytes_per_token = (
        config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes
    )
    return {
        "path": str(model_dir),
        "architecture": (config.get("architectures") or [None])[0],
        "parameters": safetensors_parameters(model_dir),
        "hidden_size": config["hidden_size"],
        "layers": config["num_hidden_layers"],
        "attention_heads": config["num_attention_heads"],
        "kv_heads": config["num_key_value_heads"],
        "head_dim": head_dim,
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config.get("max_position_embeddings"),
        "dtype": config.get("dtype"),
        "serving_dtype": serving_dtype(model_dir),
        "kv_bytes_per_token": kv_bytes_per_token,
        "note": (
            "trained on the Python standard library (training.json beside the weights); lengths are fixed"
            if (model_dir / "training.json").exists()
            else "random weights (infra/build_demo_model.py): output text is noise; lengths are fixed"
        ),
    }


def kv_plan(manifest: dict[str, Any], kv_bytes_per_token: int, block_size: int) -> dict[str, dict[str, Any]]:
    """KV cache bytes per (kv config, workload)."""
    from bench.freight_runner import PREVIOUS_KV_BYTES
    from storage.settings import Settings

    # Freight's FREIGHT_ENGINE_KV_CACHE_GIB; where that is 0 ("by the device", issue #51 part 5), its
    # previous default, as FreightStack's: every system gets the same explicit size
    default_bytes = int(Settings().engine_kv_cache_gib * 1024**3) or PREVIOUS_KV_BYTES
    block_bytes = block_size * kv_bytes_per_token
    plan: dict[str, dict[str, Any]] = {"default": {}, "tight": {}}
    for name in WORKLOADS:
        info = manifest["workloads"].get("unique" if name == "multi_job" else name)
        if info is None:  # a manifest of fewer workloads
            continue
        per_request = math.ceil((info["prompt_tokens_max"] + info["output_tokens_per_request"]) / block_size)
        running = MAX_NUM_SEQS * per_request
        blocks = max(math.ceil(running * TIGHT_FACTOR), math.ceil(MAX_MODEL_LEN / block_size))
        if name == MJSP:  # its running batch shares a few prompts: hold half of all shared prefixes
            shared = math.ceil(info["shared_prefix_tokens"] * PREFIX_TIGHT_SHARE / block_size)
            blocks = max(shared, math.ceil(MAX_MODEL_LEN / block_size) + 1)  # vLLM keeps one block back
        plan["default"][name] = _kv_entry(default_bytes, block_bytes, running, block_size)
        plan["tight"][name] = _kv_entry(blocks * block_bytes, block_bytes, running, block_size)
        if name == MJSP:
            plan["tight"][name]["rule"] = (
                f"{PREFIX_TIGHT_SHARE} x shared_prefix_tokens ({info['shared_prefix_tokens']}), "
                "at least max_model_len and one block"
            )
    return plan


def _kv_entry(kv_bytes: int, block_bytes: int, running_blocks: int, block_size: int) -> dict[str, Any]:
    return {
        "bytes": kv_bytes,
        "blocks": kv_bytes // block_bytes,
        "tokens": kv_bytes // block_bytes * block_size,
        "running_batch_blocks": running_blocks,
        "over_running_batch": round(kv_bytes / block_bytes / running_blocks, 2),
    }


# ---------------------------------------------------------------------------------------- runs


def with_rates(metrics: dict[str, Any]) -> dict[str, Any]:
    wall = metrics.get("wall_s") or 0
    prompt, cached = metrics.get("prompt_tokens"), metrics.get("cached_tokens")
    metrics["output_tok_s"] = metrics["output_tokens"] / wall if wall else None
    metrics["prompt_tok_s"] = prompt / wall if wall and prompt is not None else None
    metrics["cache_hit_rate"] = cached / prompt if cached is not None and prompt else None
    return metrics


def combine_repeats(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from repeated runs: the run with the median output rate, plus every run's figures.

    The 2-core machine is noisy (one system's wall time moves by up to 15% between runs); the
    target ratios themselves are medians of paired per-repeat ratios (bench/interleaved.py)."""
    good = [c for c in cells if "error" not in c]
    if not good:
        return cells[0]
    ranked = sorted(good, key=lambda c: c["output_tok_s"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["repeats"] = [
        {
            k: c.get(k)
            for k in (
                "wall_s",
                "output_tok_s",
                "batch_fill",
                "engine_steps",
                "cache_hit_rate",
                "errors",
                "cpu_s",
                "other_cpu_s",
                "control_roles_cpu_s",
                "phases_s",
                "kv_report",
            )
        }
        for c in cells
    ]
    median["repeat_method"] = f"median of {len(cells)} runs by output tok/s (fresh prompts per run)"
    median["spread"] = {  # every figure with its repeats: min, median and max over the good runs
        key: spread([c[key] for c in good if c.get(key) is not None]) for key in ("wall_s", "output_tok_s")
    }
    return median


def engine_flags(
    model_dir: Path, kv_bytes: int, block_size: int, eager: bool, core: str = "auto"
) -> list[str]:
    """bench.engine_baseline's engine flags: the limits every system runs at, and where its engine
    core runs (``auto``: where Freight's engine worker puts it, the faster placement on a CPU)."""
    return [
        "--core", core,
        "--model", str(model_dir), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-bytes", str(kv_bytes), "--block-size", str(block_size),
        "--dtype", serving_dtype(model_dir), *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip


def engine_repeat_files(
    names: list[str],
    systems: list[str],
    all_files: dict[str, list[Path]],
    sorted_files: dict[str, list[Path]],
    tenant_sorted: dict[str, list[Path]],
) -> tuple[dict[str, Path], tuple[Path, ...]]:
    """The engine baselines' files for these workloads, NAME[+sorted|+tenant-sorted]#rN, repeat by repeat
    (so the machine's drift falls on every variant alike), and their warm-up files (one per
    workload: the same shape, other prompts)."""
    files: dict[str, Path] = {}
    warmups: list[Path] = []
    for name in names:
        variants: list[tuple[str, list[Path]]] = []
        if "engine" in systems:
            variants.append(("", all_files[name]))
        if "engine_sorted" in systems and name in sorted_files:
            variants.append((SORTED, sorted_files[name]))
            if name in tenant_sorted:
                variants.append((TENANT_SORTED, tenant_sorted[name]))
        if variants:
            warmups.append(variants[-1][1][-1])
        for r in range(len(all_files[name]) - 1):  # the last file is the warm-up
            for suffix, paths in variants:
                files[f"{name}{suffix}{REPEAT}{r}"] = paths[r]
    return files, tuple(warmups)


ENGINE_PLACEMENTS = ("inline", "process")  # where vLLM's engine core runs (engine_baseline --core)


def faster_placement(by_core: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per engine key (one file), the cell of the core placement that ran it at the higher
    output rate (a failed run never wins), with every placement's rate beside it: the limit is
    always the faster placement (on this host the inline core was 4-23% faster in issue #51's
    runs; 7-10x slower than the process core in bench/engine_baseline on quick dups at load 5-8 on
    2026-11-28, 17-26 s against 2.1-2.5 s: measured each time, not assumed)."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(k for cells in by_core.values() for k in cells):
        cells = {core: by[key] for core, by in by_core.items() if key in by}
        good = {core: c for core, c in cells.items() if "error" not in c and c.get("output_tok_s")}
        best = max(good, key=lambda core: good[core]["output_tok_s"]) if good else next(iter(cells))
        rates = {core: c.get("output_tok_s") for core, c in cells.items()}
        out[key] = {**cells[best], "placement": best, "placements_output_tok_s": rates}
    return out


ENGINE_CELLS = {  # engine key suffix -> (cell, note)
    TENANT_SORTED: (
        "engine_sorted_tenant",
        "the lines sorted by tenant, then rendered prompt token ids, each with its tenant's cache_salt",
    ),
    SORTED: ("engine_sorted", "the lines sorted by rendered prompt token ids"),
    "": ("engine", "the lines as written"),
}


def engine_cells_by_system(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {engine | engine_sorted | engine_sorted_tenant: the median of its repeats}}
    from the engine's NAME[suffix]#rN cells (combine_repeats keeps every repeat, in order)."""
    runs: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
    for key, cell in cells.items():
        base, _, r = key.rpartition(REPEAT)
        suffix = next(x for x in ENGINE_CELLS if base.endswith(x))  # the longer suffix first
        runs.setdefault((base.removesuffix(suffix) if suffix else base, suffix), []).append((int(r), cell))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (name, suffix), numbered in runs.items():
        system, note = ENGINE_CELLS[suffix]
        combined = combine_repeats([cell for _, cell in sorted(numbered, key=lambda pair: pair[0])])
        out.setdefault(name, {})[system] = {**combined, "note": note}
    return out


def run_runbatch(
    path: Path, kv_bytes: int, out_dir: Path, eager: bool, model_dir: Path, block_size: int
) -> dict[str, Any]:
    from bench.runbatch_baseline import run

    try:
        result = run(
            path,
            out_dir / f"runbatch-{kv_bytes}",
            model=str(model_dir),
            served_model_name=wl.MODEL_NAME,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=kv_bytes,
            enforce_eager=eager,
            block_size=block_size,
            dtype=serving_dtype(model_dir),
        )
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return with_rates(result)


def repeat_of(key: str) -> tuple[str, int]:
    """(workload, repeat) of an engine key NAME[suffix]#rN."""
    base, _, r = key.rpartition(REPEAT)
    suffix = next(x for x in ENGINE_CELLS if base.endswith(x))  # the longer suffix first
    return (base.removesuffix(suffix) if suffix else base), int(r)


def engine_servers(
    args: argparse.Namespace, kv_bytes: int, run_dir: Path
) -> Callable[[str, tuple[Path, ...]], Any]:
    """A turn-about run's engine_server: a warm bench.engine_baseline server on a core placement."""
    from bench.engine_baseline import EngineServer

    def engine_server(core: str, warm: tuple[Path, ...]) -> Any:
        flags = engine_flags(args.model, kv_bytes, args.block_size, args.eager, core)
        warm_args = [arg for path in warm for arg in ("--warmup-file", str(path))]
        return EngineServer([*flags, *warm_args], run_dir / f"engine-{core}.log")

    return engine_server


def placements(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine's core placements a run measures: both under --engine-core faster."""
    return ENGINE_PLACEMENTS if args.engine_core == "faster" else (args.engine_core,)


def rotate(
    args: argparse.Namespace,
    kv_bytes: int,
    run_dir: Path,
    names: list[str],
    engine_files: dict[str, Path],
    warmups: tuple[Path, ...],
    freight_files: dict[str, list[Path]],
    roles: dict[str, Any],
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, list[dict[str, Any]]]], dict[str, Any]]:
    """bench.alternation.run_alternating at this run's limits: the engine on --engine-core's
    placements (if it has files) and ``roles``' stacks (if any), on ``freight_files``."""
    from bench.alternation import run_alternating

    return run_alternating(
        names=names,
        engine_files=engine_files,
        engine_warmups=warmups,
        freight_files=freight_files if roles else {},
        placements=placements(args) if engine_files else (),
        engine_server=engine_servers(args, kv_bytes, run_dir),
        roles=roles,
        repeat_of=repeat_of,
        with_rates=with_rates,
        log=log,
    )


def run_turn_about(
    names: list[str],
    systems: list[str],
    kv_bytes: int,
    work: Path,
    args: argparse.Namespace,
    all_files: dict[str, list[Path]],
    sorted_files: dict[str, list[Path]],
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, Any]], dict[str, Any] | None]:
    """These workloads (one KV size, one batch each) on the engine baselines, on both core placements
    under --engine-core faster, and one warm Freight stack, turn about (bench/alternation.py):
    ({placement: {engine key: cell}}, {workload: Freight's cell}, the stack's settings)."""
    from bench.alternation import FreightRole, one_batch

    run_dir = work / f"alternating-{kv_bytes}-{'-'.join(names)}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    engine_files, warmups = engine_repeat_files(names, systems, all_files, sorted_files, {})

    def stack_factory() -> Any:
        return freight_stack(run_dir / "freight", args.model, kv_bytes, args.eager, args.block_size)

    roles = {"freight": FreightRole(stack_factory, one_batch(wl.TENANTS[0]))} if "freight" in systems else {}
    by_core, runs, settings = rotate(
        args, kv_bytes, run_dir, names, engine_files, warmups, {n: all_files[n] for n in names}, roles
    )
    cells = {name: combine_repeats(repeats) for name, repeats in runs.get("freight", {}).items()}
    return by_core, cells, settings.get("freight")


def freight_stack(
    run_dir: Path,
    model_dir: Path,
    kv_bytes: int | None,
    eager: bool,
    block_size: int,
    warmup_file: Path | None = None,
    cache_sharing: str = "tenant",
) -> Any:
    """A FreightStack at the benchmark's limits; `cache_sharing` sets FREIGHT_PREFIX_CACHE_SHARING
    (Freight's default, tenant, unless a cell says global: the multi-tenant workloads run in both
    modes, so the isolation's cost is measured in the same run)."""
    from bench.freight_runner import FreightStack

    extra_env = {
        "FREIGHT_ENGINE_DTYPE": serving_dtype(model_dir),
        "FREIGHT_PREFIX_CACHE_SHARING": cache_sharing,
    }
    return FreightStack(
        run_dir,
        model_dir,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_bytes=kv_bytes,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=eager,
        block_size=block_size,
        tenants=wl.TENANTS,
        warmup_file=warmup_file,
        extra_env=extra_env,
    )


# multi_job_shared_prefix's Freight modes: cell -> (FREIGHT_PREFIX_CACHE_SHARING, how the lines are
# submitted), each a warm stack of its own in the turn-about run
MJSP_MODES = {
    "freight_single_job": ("global", "the lines as one job (tenant-a)"),
    "freight": ("global", "3 tenants x 2 jobs (split_multi_job_shared_prefix), submitted together"),
    "freight_per_tenant_1job": ("tenant", "one job per tenant (its 2 jobs' lines), submitted together"),
    "freight_per_tenant": ("tenant", "3 tenants x 2 jobs, submitted together"),
}


def run_multi_job_shared_prefix(
    paths: list[Path],
    kv: str,
    kv_bytes: int,
    work: Path,
    args: argparse.Namespace,
    systems: list[str],
    sorted_files: dict[str, list[Path]],
    tenant_sorted: dict[str, list[Path]],
) -> tuple[
    dict[str, dict[str, dict[str, Any]]],
    dict[str, dict[str, Any]],
    dict[str, Any],
    dict[str, list[float]],
]:
    """multi_job_shared_prefix turn about (bench/alternation.py): the engine's variants (as written,
    sorted, sorted by tenant with its salt) on each core placement and Freight in each of
    MJSP_MODES (--cache-sharing's), one warm stack per mode (no mode finds another's prefixes
    cached), all started and warmed on the last file of ``paths`` (the warm-up, in each mode's
    jobs), then, repeat by repeat (other prompts each), each runs that repeat while the others are
    paused, in a rotating order. Returns ({placement: {engine key: cell}}, {mode: median cell},
    {mode: its stack's settings}, the paired ratios per repeat: each mode against its one-job
    twin and tenant against global, all within one turn)."""
    from bench.alternation import FreightRole
    from bench.prefix import ideal_cache_hit_rate

    run_dir = work / f"{MJSP}-{kv}-{kv_bytes}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    tokenizer = wl.load_tokenizer(args.model)
    jobs: dict[Path, dict[str, list[tuple[str, Path]]]] = {}  # per file: role -> [(tenant, file)]
    ideal: list[float] = []  # the plan's ideal hit rate per repeat
    for r, path in enumerate(paths):  # the repeats, then the warm-up
        pieces = wl.split_multi_job_shared_prefix(path, run_dir / f"jobs-r{r}")
        per_tenant = wl.merge_by_tenant(pieces, run_dir / f"jobs-r{r}", stem=f"{path.stem}-per-tenant")
        multi = [(p["tenant"], Path(p["path"])) for p in pieces]
        jobs[path] = {
            "freight_single_job": [(wl.TENANTS[0], path)],
            "freight": multi,
            "freight_per_tenant_1job": [(p["tenant"], Path(p["path"])) for p in per_tenant],
            "freight_per_tenant": multi,
        }
        _, ids = wl.sort_by_prompt(tokenizer, wl.read_jsonl(path))
        ideal.append(ideal_cache_hit_rate(ids, args.block_size))

    def mode(role: str) -> FreightRole:
        def factory() -> Any:
            sharing = MJSP_MODES[role][0]
            return freight_stack(
                run_dir / role, args.model, kv_bytes, args.eager, args.block_size, cache_sharing=sharing
            )

        return FreightRole(factory, lambda _name, path: jobs[path][role])

    wanted = set(args.cache_sharing.split(",")) if "freight" in systems else set()
    roles = {role: mode(role) for role, (sharing, _) in MJSP_MODES.items() if sharing in wanted}
    engine_files, warmups = engine_repeat_files([MJSP], systems, {MJSP: paths}, sorted_files, tenant_sorted)
    by_core, freight_runs, settings = rotate(
        args, kv_bytes, run_dir, [MJSP], engine_files, warmups, {MJSP: paths}, roles
    )
    runs = {role: by_name.get(MJSP, []) for role, by_name in freight_runs.items()}
    for role, repeats in runs.items():
        for r, cell in enumerate(repeats):
            if "error" not in cell:
                cell.update(
                    cache_sharing=MJSP_MODES[role][0], note=MJSP_MODES[role][1], ideal_hit_rate=ideal[r]
                )
    cells = {role: combine_repeats(repeats) for role, repeats in runs.items()}
    paired: dict[str, list[float]] = {}
    for field, (mine, base) in (
        ("freight_over_single_job", ("freight", "freight_single_job")),
        ("per_tenant_over_single_job_per_tenant", ("freight_per_tenant", "freight_per_tenant_1job")),
        ("tenant_over_global", ("freight_per_tenant", "freight")),
    ):
        for a, b in zip(runs.get(mine, []), runs.get(base, []), strict=False):
            if (value := ratio(output_rate(a), output_rate(b))) is not None:
                paired.setdefault(field, []).append(value)
    for cell in runs.get("freight", []):
        if (measured := hit_rate(cell)) is not None:
            paired.setdefault("hit_rate_gap_points", []).append(100 * (cell["ideal_hit_rate"] - measured))
    return by_core, cells, settings, paired


def prepare_sorted(
    names: list[str], repeat_files: dict[str, list[Path]], model_dir: Path, block_size: int
) -> tuple[dict[str, list[Path]], dict[str, list[Path]], dict[str, float]]:
    """For each workload of SORTED_WORKLOADS, per file of ``repeat_files`` (its repeats, then its
    warm-up): its lines sorted by rendered prompt token ids (engine_sorted's file, STEM-sorted.jsonl);
    for multi_job_shared_prefix also sorted by tenant, then prompt, each line with its tenant's
    ``cache_salt`` (engine_sorted_tenant's, STEM-tenant-sorted.jsonl: the tenants of
    split_multi_job_shared_prefix, as Freight's tenant-mode runs get them); and the plan's ideal
    cache hit rate at `block_size` (bench/prefix.py) of the first file."""
    from bench.prefix import ideal_cache_hit_rate

    tokenizer = wl.load_tokenizer(model_dir)
    sorted_files: dict[str, list[Path]] = {}
    tenant_sorted: dict[str, list[Path]] = {}
    ideal: dict[str, float] = {}
    for name in names:
        if name not in SORTED_WORKLOADS:
            continue
        for r, path in enumerate(repeat_files[name]):
            ordered, ids = wl.sort_by_prompt(tokenizer, wl.read_jsonl(path))
            sorted_files.setdefault(name, []).append(path.with_name(f"{path.stem}-sorted.jsonl"))
            wl.write_jsonl(sorted_files[name][-1], ordered)
            if r == 0:
                ideal[name] = ideal_cache_hit_rate(ids, block_size)
            if name == MJSP:
                tenant_sorted.setdefault(name, []).append(tenant_sorted_file(tokenizer, path))
    return sorted_files, tenant_sorted, ideal


def tenant_sorted_file(tokenizer: Any, path: Path) -> Path:
    """The lines of a multi_job_shared_prefix file with their tenant's cache_salt (the tenant's
    name: distinct per tenant, as Freight's HMAC salts are), sorted by tenant, then prompt ids."""
    pieces = wl.split_multi_job_shared_prefix(path, path.parent / f"{path.stem}-tenants")
    tenant_of = {
        line["custom_id"]: piece["tenant"] for piece in pieces for line in wl.read_jsonl(Path(piece["path"]))
    }
    keyed = []
    for line in wl.read_jsonl(path):
        tenant = tenant_of[line["custom_id"]]
        salted = {**line, "body": {**line["body"], "cache_salt": tenant}}
        keyed.append(((tenant, wl.prompt_token_ids(tokenizer, line)), salted))
    keyed.sort(key=lambda pair: pair[0])
    out = path.with_name(f"{path.stem}-tenant-sorted.jsonl")
    wl.write_jsonl(out, [line for _, line in keyed])
    return out


def run_paired(
    names: list[str],
    systems: list[str],
    kv: str,
    kv_bytes: int,
    work: Path,
    args: argparse.Namespace,
    unique_files: list[Path],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, list[float]]], dict[str, Any]]:
    """unique and multi_job as paired runs of the engine and two warm Freight stacks."""
    from bench.interleaved import run_interleaved, warmup_file

    run_dir = work / f"paired-{kv}-{kv_bytes}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    core = "auto" if args.engine_core == "faster" else args.engine_core  # one warm engine here
    engine_argv = engine_flags(args.model, kv_bytes, args.block_size, args.eager, core)
    freight_kv = kv_bytes  # explicit: the engine baselines get the same

    def stack_factory(role: str, warm: Path) -> Any:  # multi: tenants share one cache; the rest: default
        sharing = "global" if role == "multi" else "tenant"
        return freight_stack(
            run_dir / role, args.model, freight_kv, args.eager, args.block_size, warm, cache_sharing=sharing
        )

    return run_interleaved(
        names=names,
        systems=systems,
        unique_files=unique_files,
        warm=warmup_file(work / "workloads", args.model, MAX_NUM_SEQS),
        kv_bytes=freight_kv,
        engine_argv=engine_argv,
        stack_factory=stack_factory,
        run_dir=run_dir,
        with_rates=with_rates,
        combine=combine_repeats,
        log=log,
    )


# ---------------------------------------------------------------------------------------- report


def output_rate(cell: dict[str, Any] | None) -> float | None:
    return None if not cell or "error" in cell else cell.get("output_tok_s")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def hit_rate(cell: dict[str, Any] | None) -> float | None:
    return None if not cell or "error" in cell else cell.get("cache_hit_rate")


def kv_report_fields(cell: dict[str, Any] | None) -> dict[str, float | None]:
    """KV-aware admission's figures of a Freight cell, the worst of its repeats (freight_runner's
    kv_report): vLLM's preemptions and the hit-rate gap to the plan in points; None where no
    repeat counted them (a core in its own process; admission by count)."""
    runs = (cell or {}).get("repeats") or [cell or {}]
    reports = [r.get("kv_report") or {} for r in runs]
    preempted = [r["preemptions"] for r in reports if r.get("preemptions") is not None]
    gaps = [r["hit_rate_gap_points"] for r in reports if r.get("hit_rate_gap_points") is not None]
    return {
        "preemptions": max(preempted) if preempted else None,
        "kv_plan_gap_points": max(gaps) if gaps else None,
    }


def compute_ratios(
    results: dict[str, Any],
    paired: dict[str, dict[str, list[float]]] | None = None,
    ideal: dict[str, float] | None = None,
) -> dict[str, dict[str, float | None]]:
    """Output-rate ratios per workload and KV size; where paired runs exist (unique, multi_job),
    the median of the per-repeat ratios replaces the ratio of the median runs. `ideal`: the plan's
    ideal cache hit rate per workload (multi_job_shared_prefix's hit_rate_gap_points)."""
    from bench.interleaved import median_ratios

    ratios: dict[str, dict[str, float | None]] = {}
    for name, by_kv in results.items():
        for kv, cells in by_kv.items():
            key = name if kv == "default" else f"{name}_{kv}_kv"
            freight = output_rate(cells.get("freight"))
            entry = {
                "freight_over_engine": ratio(freight, output_rate(cells.get("engine"))),
                "freight_over_runbatch": ratio(freight, output_rate(cells.get("runbatch"))),
                "runbatch_over_engine": ratio(
                    output_rate(cells.get("runbatch")), output_rate(cells.get("engine"))
                ),
            }
            if name == "multi_job":
                single = output_rate(cells.get("freight_single_job"))
                tenant = output_rate(cells.get("freight_tenant"))
                entry["freight_over_single_job"] = ratio(freight, single)
                entry["freight_tenant_over_single_job"] = ratio(tenant, single)
                entry["tenant_over_global"] = ratio(tenant, freight)
            engine_sorted = output_rate(cells.get("engine_sorted"))
            if "engine_sorted" in cells:
                entry["engine_sorted_over_engine"] = ratio(engine_sorted, output_rate(cells.get("engine")))
                entry["freight_over_engine_sorted"] = ratio(freight, engine_sorted)
            if name == MJSP:  # "freight" is the multi-job run (b), as in multi_job
                single = output_rate(cells.get("freight_single_job"))
                best, measured = (ideal or {}).get(name), hit_rate(cells.get("freight"))
                entry.update(
                    {
                        "freight_over_single_job": ratio(freight, single),
                        "per_tenant_over_single_job_per_tenant": ratio(
                            output_rate(cells.get("freight_per_tenant")),
                            output_rate(cells.get("freight_per_tenant_1job")),
                        ),
                        # the isolation's cost: the same six jobs, tenant over global
                        "tenant_over_global": ratio(output_rate(cells.get("freight_per_tenant")), freight),
                        "freight_over_engine_sorted": ratio(single, engine_sorted),
                        "multi_job_over_engine_sorted": ratio(freight, engine_sorted),
                        "ideal_hit_rate": best,
                        "hit_rate_gap_points": (
                            None if best is None or measured is None else 100 * (best - measured)
                        ),
                    }
                )
            if kv == "tight" and name in KV_REPORT_WORKLOADS:
                entry.update(kv_report_fields(cells.get("freight")))
            ratios[key] = entry
    for key, fields in median_ratios(paired or {}).items():
        for field, value in fields.items():
            if value is not None:
                ratios.setdefault(key, {})[field] = value
    for key in TARGETS:  # the named ratios always exist, null when not measured
        group, field = key.split(".")
        ratios.setdefault(group, {}).setdefault(field, None)
    return ratios


def evaluate_targets(
    ratios: dict[str, dict[str, float | None]], paired: dict[str, dict[str, list[float]]] | None = None
) -> dict[str, dict[str, Any]]:
    """{key: {value, bound, op, min | max, pass, spread}} (pass null when not measured); ``spread``:
    the per-repeat values the value is the median of, with their count, min, median and max."""
    out = {}
    for key, (op, bound) in TARGETS.items():
        group, field = key.split(".")
        value = ratios.get(group, {}).get(field)
        passed = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out[key] = {
            "value": value,
            "bound": bound,
            "op": op,
            ("min" if op == ">=" else "max"): bound,
            "pass": passed,
            "spread": spread((paired or {}).get(group, {}).get(field, [])),
        }
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any], ratios: dict[str, Any], targets: dict[str, Any]) -> str:
    rows = [
        f"{'workload':23s} {'kv':8s} {'system':23s} {'wall s':>8s} {'out tok/s':>10s} {'prompt tok/s':>12s}"
        f" {'hit':>6s} {'fill':>6s} {'err':>4s}"
    ]
    for name, by_kv in results.items():
        for kv, cells in by_kv.items():
            for system, cell in cells.items():
                if "error" in cell:
                    rows.append(f"{name:23s} {kv:8s} {system:23s} ERROR {cell['error'][:70]!r}")
                    continue
                rows.append(
                    f"{name:23s} {kv:8s} {system:23s} {_fmt(cell.get('wall_s'), '8.1f')}"
                    f" {_fmt(cell.get('output_tok_s'), '10.1f')} {_fmt(cell.get('prompt_tok_s'), '12.1f')}"
                    f" {_fmt(cell.get('cache_hit_rate'), '6.1%')} {_fmt(cell.get('batch_fill'), '6.1%')}"
                    f" {_fmt(cell.get('errors'), '4d')}"
                )
    rows.append("")
    rows.append("ratios (output tok/s; hit_rate_gap_points in points, ideal_hit_rate a fraction):")
    for key, entry in ratios.items():
        parts = [f"{k}={_fmt(v, '.2f')}" for k, v in entry.items()]
        rows.append(f"  {key:32s} {'  '.join(parts)}")
    rows.append("targets:")
    for key, t in targets.items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        rows.append(f"  {key:70s} {t['op']} {t['bound']:<5} {_fmt(t['value'], '6.2f')}  {verdict}")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"every workload x{QUICK_SCALE} (smoke run)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager in every system (faster starts)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder of workloads and runs (default: var/bench/<run's name>)",
    )
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="checkpoint every system serves")
    parser.add_argument(
        "--engine-core",
        choices=("faster", "auto", "inline", "process"),
        default="faster",
        help="the engine baselines' core placement: faster (both run, the faster per file: the "
        "limit), auto (Freight's choice, inline on a CPU), inline or process; the paired runs of "
        "unique and multi_job keep one warm engine, auto under faster",
    )
    parser.add_argument(
        "--block-size", type=int, default=BLOCK_SIZE, help="KV block (tokens) of every system"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--kv", default=",".join(KV_CONFIGS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of unique/multi_job on fresh prompts (default 3; 1 --quick)",
    )
    parser.add_argument(
        "--cache-sharing",
        default="global,tenant",
        help="multi_job_shared_prefix's pairs to run: global (one job / six), tenant (one per tenant / six)",
    )
    parser.add_argument(
        "--doc-tokens", type=int, default=wl.DOC_TOKENS, help="shared_prefix document length in tokens"
    )
    args = parser.parse_args(argv)
    prov = Run("bench.scheduler", MEASURES, argv)
    names = [n for n in args.workloads.split(",") if n]
    kvs = [k for k in args.kv.split(",") if k]
    systems = [s for s in args.systems.split(",") if s]
    for given, allowed in ((names, WORKLOADS), (kvs, KV_CONFIGS), (systems, SYSTEMS)):
        if unknown := set(given) - set(allowed):
            parser.error(f"unknown {sorted(unknown)}; choose from {', '.join(allowed)}")
    scale = QUICK_SCALE if args.quick else 1.0
    out_path = args.out or RESULTS_DIR / ("scheduler-quick.json" if args.quick else "scheduler.json")
    work = args.work or WORK_DIR / (
        ("quick" if args.quick else "full")
        + (f"-docs{args.doc_tokens}" if args.doc_tokens != wl.DOC_TOKENS else "")
        + ("" if args.model == MODEL_DIR else f"-{args.model.name}")
        + ("" if args.block_size == BLOCK_SIZE else f"-block{args.block_size}")
    )
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    began = time.monotonic()

    log(f"generating workloads (scale {scale}) into {work}")
    repeats = args.repeats or (1 if args.quick else 3)
    manifest = wl.generate(
        work / "workloads",
        scale,
        args.model,
        doc_tokens=args.doc_tokens,
        unique_repeats=repeats,
        repeat_all=True,
    )
    files = {n: work / "workloads" / f for n, f in wl.WORKLOAD_FILES.items()}
    unique_files = [work / "workloads" / f for f in manifest["unique_repeat_files"]]
    # per workload: its repeat files (other prompts each), then its warm-up file (the last)
    all_files = {
        n: [work / "workloads" / f for f in (*manifest["repeat_files"][n], manifest["warmup_files"][n])]
        for n in manifest["repeat_files"]
    }
    model = model_facts(args.model)
    plan = kv_plan(manifest, model["kv_bytes_per_token"], args.block_size)
    sorted_files, tenant_sorted, ideal = prepare_sorted(names, all_files, args.model, args.block_size)
    for name, rate in ideal.items():
        manifest["workloads"][name][f"ideal_cache_hit_rate_block{args.block_size}"] = rate
    # each step's output kept beside the workloads: a run cut short resumes at its first step not
    # yet measured on this code, command, inputs and kind of machine (bench/step_checkpoints.py)
    steps = StepCheckpoints(
        work / "steps.json",
        prov.command,
        MEASURES,
        inputs_digest(p for p in (work / "workloads").iterdir() if p.is_file()),
        log=log,
    )
    results: dict[str, dict[str, dict[str, Any]]] = {n: {kv: {} for kv in kvs} for n in names}
    freight_settings: dict[str, Any] = {}
    paired: dict[str, dict[str, list[float]]] = {}  # ratio group -> ratio -> value per repeat

    for kv in kvs:
        # stacks/engines by KV size: workloads with the same size share one (default: all of them)
        groups: dict[int, list[str]] = {}
        for name in names:
            groups.setdefault(plan[kv][name]["bytes"], []).append(name)
        for kv_bytes, group in groups.items():
            # unique and multi_job: paired runs with all systems warm at once (bench/interleaved.py)
            paired_names = [n for n in group if n in ("unique", "multi_job")]
            rest = [n for n in group if n not in paired_names]
            # the workloads measured against the limit: every system warm at once, run turn about
            alternating = [n for n in rest if n != MJSP]
            if alternating and ({"engine", "engine_sorted", "freight"} & set(systems)):
                log(f"alternating: {kv} KV ({kv_bytes} bytes): {', '.join(alternating)}")
                turn_cores, turn_cells, turn_settings = steps.run(
                    f"alternating:{kv}:{kv_bytes}:{'+'.join(alternating)}",
                    functools.partial(
                        run_turn_about, alternating, systems, kv_bytes, work, args, all_files, sorted_files
                    ),
                )
                for name, by_system in engine_cells_by_system(faster_placement(turn_cores)).items():
                    results[name][kv].update(by_system)
                if turn_settings:
                    freight_settings[f"{kv}:{'+'.join(alternating)}"] = turn_settings
                for name, cell in turn_cells.items():
                    results[name][kv]["freight"] = cell
            # multi_job_shared_prefix: its engine variants and Freight's four modes, turn about
            if MJSP in rest and ({"engine", "engine_sorted", "freight"} & set(systems)):
                log(f"alternating: {kv} KV ({kv_bytes} bytes): {MJSP}")
                mjsp_cores, cells, settings_by_role, mjsp_paired = steps.run(
                    f"{MJSP}:{kv}:{kv_bytes}",
                    functools.partial(
                        run_multi_job_shared_prefix,
                        all_files[MJSP],
                        kv,
                        kv_bytes,
                        work,
                        args,
                        systems,
                        sorted_files,
                        tenant_sorted,
                    ),
                )
                for name, by_system in engine_cells_by_system(faster_placement(mjsp_cores)).items():
                    results[name][kv].update(by_system)
                results[MJSP][kv].update(cells)
                for role, settings in settings_by_role.items():
                    freight_settings[f"{kv}:{MJSP}:{role}"] = settings
                if mjsp_paired:
                    paired[MJSP if kv == "default" else f"{MJSP}_{kv}_kv"] = mjsp_paired
            if "runbatch" in systems:
                for name in rest + (["unique"] if paired_names else []):
                    log(f"run-batch: {name}, {kv} KV ({kv_bytes} bytes)")
                    cell = steps.run(
                        f"runbatch:{kv}:{kv_bytes}:{name}",
                        functools.partial(
                            run_runbatch, files[name], kv_bytes, work, args.eager, args.model, args.block_size
                        ),
                    )
                    if name in results:
                        results[name][kv]["runbatch"] = cell
                    if name == "unique" and "multi_job" in results:
                        results["multi_job"][kv]["runbatch"] = {
                            **cell,
                            "note": "the same lines in one file (unique)",
                        }
            if paired_names and ({"engine", "freight"} & set(systems)):
                cells_by_name, ratio_lists, settings_by_role = steps.run(
                    f"paired:{kv}:{kv_bytes}:{'+'.join(paired_names)}",
                    functools.partial(
                        run_paired, paired_names, systems, kv, kv_bytes, work, args, unique_files
                    ),
                )
                for name, cells in cells_by_name.items():
                    results[name][kv].update(cells)
                for role, settings in settings_by_role.items():
                    freight_settings[f"{kv}:{'+'.join(paired_names)}:{role}"] = settings
                for name, fields in ratio_lists.items():
                    paired[name if kv == "default" else f"{name}_{kv}_kv"] = fields
            partial = {"partial": True, "results": results}
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(partial, indent=2, default=str) + "\n")

    for key, fields in limit_ratio_lists(results).items():  # Freight over the limit, per repeat
        paired.setdefault(key, {}).update(fields)
    ratios = compute_ratios(results, paired, ideal)
    targets = evaluate_targets(ratios, paired)
    report = {
        "benchmark": "scheduler (issues #3, #24)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "duration_s": round(time.monotonic() - began, 1),
        "machine": machine_facts(),
        "model": model,
        "settings": {
            "common": {
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "max_model_len": MAX_MODEL_LEN,
                "block_size": args.block_size,
                "enable_prefix_caching": True,
                "enforce_eager": args.eager,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
                "tight_factor": TIGHT_FACTOR,
                "repeats": repeats,
                "engine_core": args.engine_core,  # the engine baselines' (--core); auto: Freight's choice
            },
            "kv_cache": plan,
            "engine": "vllm.LLM(..., enable_prefix_caching=True, seed=0, disable_log_stats=True); with "
            "--engine-core faster (the default) one engine process per core placement (inline, process) "
            "and per file the faster one's run (cell.placement, placements_output_tok_s; the paired "
            "unique/multi_job engine: Freight's choice, inline on a CPU); one LLM.chat call per file, lines "
            "in file order; start-up, 8 warm-up requests and a warm-up file of each workload's shape "
            "with other prompts (NAME-warm.jsonl; for unique, unique-warmup.jsonl) excluded; prefix "
            "cache reset before each file; each repeat file (other prompts) measured once, the cell is "
            "the median; batch_fill and steps from a second, unmeasured run of the same lines",
            "engine_sorted": "the engine (same process and limits) on NAME-sorted.jsonl: the lines sorted "
            "by their prompt token ids (tokenizer.apply_chat_template, generation prompt added); the "
            "limit of every workload it runs on",
            "engine_sorted_tenant": "multi_job_shared_prefix: the engine on the lines sorted by tenant, "
            "then prompt token ids, each with its tenant's cache_salt (LLM.generate on the rendered "
            "token ids): the limit of the tenant cache-sharing runs",
            "runbatch": "python -m vllm.entrypoints.openai.run_batch --enable-prompt-tokens-details "
            "--enable-metrics (gauge scraped for fill) --seed 0, limits as above; whole process timed",
            "freight": freight_settings,
        },
        "workloads": manifest,
        "results": results,
        "ratios": ratios,
        "paired_ratios": paired,
        "targets": targets,
        "engine_cpu": engine_cpu(results),
        "provenance": {
            **prov.finish(
                {
                    f"{name}.{ratio}": values
                    for name, fields in paired.items()
                    for ratio, values in fields.items()
                }
            ),
            "steps": steps.record,  # each step's revision and times; taken: measured by an earlier run
        },
        "notes": [
            "the limit (issue #51): engine_sorted where it runs, else engine; multi_job_shared_prefix's "
            "tenant-mode cells against engine_sorted_tenant. *_over_limit is Freight's output rate over "
            "the limit's, repeat by repeat on the same file, the median of those (targets[...].spread "
            "gives the repeats, min, median and max): every workload >= 0.97, dups >= 1.2",
            CPU_NOTE,
            "output_tok_s and prompt_tok_s are tokens over each system's wall_s; cache_hit_rate = cached / prompt tokens",
            "batch_fill: engine = time-weighted num_running_reqs per step; runbatch = mean of the "
            "vllm:num_requests_running gauge while busy; freight = the engine worker's engine_samples rows "
            "(mean running / max_num_seqs, weighted by each sample's overlap with the run)",
            "unique and multi_job: paired runs (bench/interleaved.py): the engine (--serve), Freight "
            "stack A (the file as one batch) and Freight stack B (the same lines as 20 batches from 3 "
            "tenants) warm at once, warmed on unique-warmup.jsonl (4 x max_num_seqs requests of the "
            "unique shape); each repeat gives all three the same fresh file with the other two "
            "paused (SIGSTOP), in an order rotating per repeat. Cells are the median run; the ratios "
            "unique.freight_over_engine and multi_job.freight_over_single_job (and multi_job."
            "freight_over_engine) are medians of the per-repeat ratios in paired_ratios",
            "cache modes: every stack runs Freight's default FREIGHT_PREFIX_CACHE_SHARING=tenant "
            "except multi_job's freight (stack B) and multi_job_shared_prefix's freight_single_job "
            "and freight (global); multi_job's freight_tenant is a third warm stack C running stack "
            "B's 20 batches in tenant mode in the same rotation. The isolation's cost: "
            "ratios.multi_job.tenant_over_global (C over B, per repeat) and "
            "ratios.multi_job_shared_prefix*.tenant_over_global (freight_per_tenant over freight, "
            "per repeat file); multi_job.freight_tenant_over_single_job is the default mode's "
            "multi-job target",
            "multi_job_shared_prefix: freight_single_job = (a) the lines as one job, freight = (b) 3 "
            "tenants x 2 jobs submitted together (FREIGHT_PREFIX_CACHE_SHARING=global), "
            "freight_per_tenant = (c) the same jobs with FREIGHT_PREFIX_CACHE_SHARING=tenant, "
            "freight_per_tenant_1job = (d) one job per tenant, tenant sharing; a fresh stack per mode, "
            "the stacks of (a, b) and of (d, c) warm together and measured back to back, once per "
            "repeat file (other prompts each time), the order of the two alternating per repeat; a "
            "cell is the median run and its ratios (freight_over_single_job, "
            "per_tenant_over_single_job_per_tenant, hit_rate_gap_points) are medians of the per-repeat "
            "values in paired_ratios. engine and engine_sorted run the first file only. "
            "ideal_hit_rate: the lines prefix-sorted as one job, sum of floor(lcp(prev, cur) / block) "
            "* block over prompt tokens; hit_rate_gap_points = 100 x (ideal - (b)'s hit rate)",
        ],
    }
    write_report(out_path, report)
    print(table(results, ratios, targets))
    print(f"\nwritten {out_path.relative_to(REPO) if out_path.is_relative_to(REPO) else out_path}"
          f" in {report['duration_s']:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
