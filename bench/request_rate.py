"""Request-rate benchmark (issue #21 s2): many tiny requests, where Freight's own per-request
costs rather than the engine decide throughput.

    python -m bench.request_rate [--requests 20000] [--repeats 3] [--profile] [--out FILE]

On a GPU the engine finishes hundreds to thousands of requests a second; on this CPU it only does
so for requests this small (a few prompt tokens, 1-4 output tokens), so this workload is where
validation, packing, feeding, recording and finalization show. Three systems, at the same limits
(the demo model, ``--max-num-seqs`` sequences, the same KV cache bytes, compiled unless
``--eager``), run each repeat's file one after the other while the others are paused (SIGSTOP),
each going first in turn:

  engine_process vLLM in process, ``LLM.chat`` on the whole file (bench/engine_baseline.py's
                 server), its engine core in a process of its own (vLLM's default)
  engine_inline  the same with the engine core inside the calling process
                 (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), what Freight's engine workers do on a CPU
                 (FREIGHT_ENGINE_CORE=auto): the baseline gets the same choice Freight made
  freight        Freight end to end: the file as one batch through the Batch API on a warm stack
  freight_baseline  with ``--baseline-rev REV``: the same, with every process of a second stack
                 running REV's code (a git worktree of it), so that a change's worth is measured
                 inside one run, repeat by repeat (``freight_over_baseline``): on this 2-core VM,
                 runs an hour apart differed more (0.80-0.99) than the changes being measured
  freight_tracing  with ``--tracing``: a second stack of this code with OpenTelemetry tracing on
                 (``OTEL_EXPORTER_OTLP_ENDPOINT`` at bench/otlp_sink.py's receiver in this process,
                 every span sampled and exported), in turn with the others: ``tracing_over_plain``
                 is its requests/s over ``freight``'s, repeat by repeat; the spans received and
                 their count per request are reported

Reported: requests/s of each (wall clock, start-up excluded), the ratio per repeat against the
faster of the two engines in that repeat and its median (target ``freight_over_engine`` >= 0.9;
the ratio to each engine is reported too), and Freight's CPU seconds per 1,000 requests by process
(API, control, beat, the engine worker's Python side, vLLM's processes). ``--profile`` adds one
unmeasured Freight run under py-spy (sampling the API, the control worker's processes and the engine
worker's Python side, not vLLM's processes) and records each process's top functions by own samples.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.otlp_sink import OtlpSink
from bench.provenance import STACK, Run, machine_facts, revision
from bench.scheduler import REPO, RESULTS_DIR, WORK_DIR, log, serving_dtype, write_report

MODEL_DIR = Path("models/demo")
REQUESTS = 20_000
PROMPT_WORDS = 10  # ~10 distinct words: every prompt unique, nothing for the prefix cache
OUTPUT_TOKENS = (1, 4)  # uniform, inclusive: ignore_eos, so exactly this many per request
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's LLMEngine default on CPU: what Freight's engine gets
MAX_MODEL_LEN = 2048
KV_BYTES = 256 * 1024**2
TARGET = 0.9  # freight_over_engine (requests/s), issue #21
# the in-process engine's two ways to hold its core: vLLM's default (a process of its own) and
# inside the caller, as Freight's engine workers do on a CPU; the --core each one starts with
ENGINE_CORES = {"engine_process": "process", "engine_inline": "inline"}  # system -> engine_baseline --core
PROFILE_RATE = 200  # py-spy samples per second
TOP_FUNCTIONS = 25
# the SDK's batching exporter sends every 5 s (OTEL_BSP_SCHEDULE_DELAY): the traced stack runs on
# this long after its run, unmeasured, so the run's spans are sent before it is paused (SIGSTOP)
EXPORT_WAIT_S = 6.0


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (*STACK, "bench/request_rate.py", "bench/freight_runner.py", "bench/engine_baseline.py")


def lines(n: int, seed: int | str, output_tokens: int | None = None) -> list[dict[str, Any]]:
    """n chat requests, each a unique few-word prompt and 1-4 output tokens (seeded), or exactly
    ``output_tokens`` each (the prompts stay those of the same seed: the length is drawn either way)."""
    rng = random.Random(f"request-rate-{seed}")
    words = [f"w{rng.randrange(100_000)}" for _ in range(4096)]
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))
        drawn = rng.randint(*OUTPUT_TOKENS)
        line = wl.request_line(
            f"rr-{seed}-{i:06d}", [{"role": "user", "content": text}], output_tokens or drawn
        )
        out.append(line)
    return out


def engine_argv(model: Path, eager: bool, max_num_seqs: int) -> list[str]:
    return [
        "--model", str(model), "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-bytes", str(KV_BYTES), "--dtype", serving_dtype(model),
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip


def per_thousand(cpu: dict[str, float], requests: int) -> dict[str, float]:
    """CPU seconds per 1,000 requests by process role."""
    return {role: round(1000 * seconds / requests, 3) for role, seconds in cpu.items()} if requests else {}


def rate_cell(run: dict[str, Any], requests: int) -> dict[str, Any]:
    wall = run.get("wall_s")
    cell = {
        "wall_s": wall,
        "requests": requests,
        "requests_per_s": requests / wall if wall else None,
        "errors": run.get("errors"),
        "output_tokens": run.get("output_tokens"),
        "cpu_s": run.get("cpu_s", {}),
        "other_cpu_s": run.get("other_cpu_s"),
        "cpu_s_per_1000_requests": per_thousand(run.get("cpu_s", {}), requests),
    }
    for key in ("batch_fill", "phases_s"):  # Freight's: its engine's fill, where its wall time went
        if key in run:
            cell[key] = run[key]
    return cell


def paired_ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Freight's requests/s over each engine's, per repeat, and over the faster engine of each
    repeat (``freight_over_engine``, the target's figure); over the baseline revision's Freight
    (``freight_over_baseline``) when it ran. A repeat with an error counts for none."""

    def rate(run: dict[str, Any]) -> float | None:
        return None if run.get("errors") else run.get("requests_per_s")

    systems = {name: name for name in ENGINE_CORES}  # ratio's name -> the system in `runs`
    if "freight_baseline" in runs:
        systems["baseline"] = "freight_baseline"
    out: dict[str, list[float]] = {"freight_over_engine": []}
    out.update({f"freight_over_{name}": [] for name in systems})
    for r, freight in enumerate(runs["freight"]):
        theirs = {
            name: rate(runs[system][r]) if r < len(runs[system]) else None for name, system in systems.items()
        }
        mine = rate(freight)
        if not mine:
            continue
        for name, rate_ in theirs.items():
            if rate_:
                out[f"freight_over_{name}"].append(mine / rate_)
        engines = [rate_ for name in ENGINE_CORES if (rate_ := theirs[name])]
        if len(engines) == len(ENGINE_CORES):
            out["freight_over_engine"].append(mine / max(engines))
    if "freight_tracing" in runs:  # tracing's cost: the traced stack over the plain one, per repeat
        out["tracing_over_plain"] = [
            traced / plain
            for t, p in zip(runs["freight_tracing"], runs["freight"], strict=False)
            if (traced := rate(t)) and (plain := rate(p))
        ]
    return out


def checkout(rev: str, into: Path) -> str:
    """A detached git worktree of ``rev`` at ``into`` (its processes run its code: a stack's
    working directory comes first on their sys.path); returns the commit."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=True)
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), rev],
        capture_output=True,
        check=True,
    )
    return revision(into)


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


# ------------------------------------------------------------------------------------ profiling


def start_profilers(pids: dict[str, int], out_dir: Path) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    """One ``py-spy record`` per process (raw collapsed stacks), stopped by ``stop_profilers``."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    started = []
    for role, pid in pids.items():
        path = out_dir / f"{role}.txt"
        argv = [spy, "record", "--pid", str(pid), "--rate", str(PROFILE_RATE), "--format", "raw",
                "--output", str(path), "--nonblocking"]  # fmt: skip
        if role == "control":  # a supervisor: its per-queue worker processes do the work
            argv.append("--subprocesses")
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append((role, path, proc))
    return started


def stop_profilers(started: list[tuple[str, Path, subprocess.Popen[bytes]]]) -> dict[str, Any]:
    """SIGINT makes py-spy write its file; each process's top functions by own samples."""
    out: dict[str, Any] = {}
    for role, path, proc in started:
        proc.send_signal(2)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not path.exists():
            out[role] = {"error": (err or b"").decode(errors="replace")[-500:] or "py-spy wrote nothing"}
            continue
        out[role] = top_functions(path.read_text(errors="replace"))
        out[role]["file"] = str(path)
    return out


def top_functions(raw: str, top: int = TOP_FUNCTIONS) -> dict[str, Any]:
    """From py-spy's raw format (``frame;frame;...;leaf count`` per line, frames
    ``function (file:line)``): samples by leaf function (own time) and by any frame on the stack
    (total time), the idle threads' waits left in (they show where nothing happens)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    return {
        "samples": samples,
        "own": [(name, round(n / samples, 4)) for name, n in own.most_common(top)] if samples else [],
        "total": [(name, round(n / samples, 4)) for name, n in total.most_common(top)] if samples else [],
    }


def _frame(frame: str) -> str:
    """``function (path/to/module.py:123)`` -> ``module.py:function`` (lines merged)."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1] if where else ""
    return f"{file}:{name}" if file else name


def merge_into_control_plane(report: dict[str, Any], out: Path, control_plane: Path) -> None:
    """The ratio, its target and the CPU figures as the ``request_rate`` section of
    bench/results/control_plane.json, where issue #21's targets are read together."""
    from bench.dispatcher_report import merge_results, target

    section = {
        k: report[k] for k in ("generated_at", "machine", "workload", "ratios", "paired_ratios", "provenance")
    }
    section["freight_cpu_s_per_1000_requests"] = [
        r["cpu_s_per_1000_requests"] for r in report["runs"]["freight"]
    ]
    section["other_cpu_s"] = {
        role: [r.get("other_cpu_s") for r in runs] for role, runs in report["runs"].items()
    }
    section["details"] = (
        str(out.resolve().relative_to(REPO)) if out.resolve().is_relative_to(REPO) else str(out)
    )
    value = report["ratios"]["freight_over_engine"]
    merge_results(
        control_plane,
        json.loads(json.dumps(section, default=str)),
        {"request_rate_freight_over_engine": target(value, TARGET, ">=")},
        name="request_rate",
    )


# ------------------------------------------------------------------------------------------ main


def run_turn(
    handle: Any, engine: bool, path: Path, requests: int, sink: OtlpSink | None
) -> tuple[dict[str, Any], int | None]:
    """One system's run of one repeat's file, resumed for it and paused after: its cell, and the
    spans ``sink`` received meanwhile (the traced stack's; None for the others)."""
    handle.resume()
    before = sink.counts()[0] if sink is not None else 0
    try:
        run = handle.run(path) if engine else handle.run_jobs([(handle.tenants[0], path)])
        if sink is not None:  # after the measured wall: the run's spans sent before the pause
            time.sleep(EXPORT_WAIT_S)
    finally:
        handle.pause()
    return rate_cell(run, requests), None if sink is None else sink.counts()[0] - before


def start_traced(args: argparse.Namespace, run_dir: Path, warm: Path, sink: OtlpSink) -> Any:
    """``--tracing``'s stack: this code with every process's spans exported to ``sink``, started,
    warmed and paused."""
    from bench.freight_runner import FreightStack

    log(f"request rate: starting a Freight stack with tracing to {sink.endpoint}")
    traced = FreightStack(
        run_dir, args.model, max_num_seqs=args.max_num_seqs, kv_cache_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN, enforce_eager=args.eager, warmup_file=warm,
        extra_env={"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "freight-bench",
                   "OTEL_TRACES_SAMPLER": "parentbased_always_on"},
    ).start()  # fmt: skip
    time.sleep(EXPORT_WAIT_S)  # the warm-up's spans sent before the stack is paused
    traced.pause()
    return traced


def tracing_summary(sink: OtlpSink | None, spans: list[int], requests: int) -> dict[str, Any] | None:
    """The spans the traced stack exported (None without ``--tracing``)."""
    if sink is None:
        return None
    return {
        "spans_received": sink.counts()[0],
        "spans_per_repeat": spans,
        "spans_per_request": [n / requests for n in spans],
        "note": (
            "freight_tracing: every process of a second stack with OTEL_EXPORTER_OTLP_ENDPOINT at "
            "bench/otlp_sink.py in the benchmark's process (always-on sampling, the SDK's batching "
            "OTLP/HTTP exporter); tracing_over_plain = its requests/s over freight's, per repeat. "
            "Spans counted from a repeat's start to 6 s after its end (unmeasured), the exporter's "
            "batches sent by then"
        ),
    }


def targets(over_engine: float | None, over_baseline: float | None) -> dict[str, Any]:
    """The request rate's target, and with ``--baseline-rev`` that this code is no slower than
    that revision's (``make bench-head-start``: the early slices against the code before them)."""
    found = {
        "freight_over_engine": {
            "value": over_engine,
            "bound": f">= {TARGET}",
            "pass": over_engine is not None and over_engine >= TARGET,
        }
    }
    if over_baseline is not None:
        found["freight_over_baseline"] = {
            "value": over_baseline,
            "bound": ">= 1.0",
            "pass": over_baseline >= 1.0,
        }
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--eager", action="store_true", help="enforce_eager in both systems")
    parser.add_argument("--profile", action="store_true", help="one more Freight run under py-spy")
    parser.add_argument(
        "--baseline-rev",
        help="also run Freight at this git revision (a worktree of it), in turn with the others",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also run Freight with OpenTelemetry tracing on, exporting to a local receiver",
    )
    parser.add_argument(
        "--head-rows",
        type=int,
        default=None,
        help="FREIGHT_VALIDATION_HEAD_ROWS of this code's stack (early slices; 0: off); default: Freight's",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "request_rate.json")
    parser.add_argument(
        "--control-plane",
        default=str(RESULTS_DIR / "control_plane.json"),
        help="the file the ratio and its target are merged into ('' for none)",
    )
    args = parser.parse_args(argv)
    prov = Run("bench.request_rate", MEASURES, argv)

    from bench.engine_baseline import EngineServer
    from bench.freight_runner import FreightStack

    started = time.monotonic()
    work = WORK_DIR / "request-rate"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    files = []
    for r in range(args.repeats + 1):  # the last one is the warm-up (and profiling) file
        path = work / f"rate-{r}.jsonl"
        wl.write_jsonl(path, lines(args.requests if r < args.repeats else max(1, args.requests // 4), r))
        files.append(path)
    warm = files.pop()
    log(f"request rate: {args.repeats} x {args.requests} requests, warm-up {warm.name}")

    engines: dict[str, Any] = {}
    stack = None
    baseline = None
    baseline_src = work / "baseline-src"
    freights = ("freight", "freight_baseline") if args.baseline_rev else ("freight",)
    if args.tracing:
        freights = (*freights, "freight_tracing")
    traced = None
    sink = None
    spans: list[int] = []  # the spans the traced stack exported, per repeat
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in (*ENGINE_CORES, *freights)}
    code = {"freight": revision(REPO)}
    profile: dict[str, Any] | None = None
    freight_settings: dict[str, Any] = {}
    try:
        for name, core in ENGINE_CORES.items():
            log(f"request rate: starting the in-process engine ({name})")
            engines[name] = EngineServer(
                [*engine_argv(args.model, args.eager, args.max_num_seqs), "--warmup-file", str(warm),
                 "--core", core],
                work / f"{name}-serve.log",
            )  # fmt: skip
            engines[name].pause()
        log("request rate: starting a Freight stack")
        stack = FreightStack(
            work / "freight", args.model, max_num_seqs=args.max_num_seqs, kv_cache_bytes=KV_BYTES,
            max_model_len=MAX_MODEL_LEN, enforce_eager=args.eager, warmup_file=warm,
            extra_env={} if args.head_rows is None else {"FREIGHT_VALIDATION_HEAD_ROWS": str(args.head_rows)},
        ).start()  # fmt: skip
        freight_settings = stack.settings()
        stack.pause()
        systems: dict[str, Any] = {**engines, "freight": stack}
        if args.baseline_rev:
            code["freight_baseline"] = checkout(args.baseline_rev, baseline_src)
            log(f"request rate: starting a Freight stack at {code['freight_baseline']}")
            baseline = FreightStack(
                work / "freight-baseline", args.model, max_num_seqs=args.max_num_seqs,
                kv_cache_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN, enforce_eager=args.eager,
                warmup_file=warm, code_dir=baseline_src,
            ).start()  # fmt: skip
            baseline.pause()
            systems["freight_baseline"] = baseline
        if args.tracing:
            sink = OtlpSink()
            traced = systems["freight_tracing"] = start_traced(args, work / "freight-tracing", warm, sink)
        names = list(systems)
        for r, path in enumerate(files):
            order = names[r % len(names) :] + names[: r % len(names)]  # each system first in turn
            for role in order:
                log(f"request rate: repeat {r + 1}/{len(files)}: {role}")
                exported = sink if role == "freight_tracing" else None
                cell, sent = run_turn(systems[role], role in engines, path, args.requests, exported)
                runs[role].append(cell)
                if sent is not None:
                    spans.append(sent)
        if args.profile:
            stack.resume()
            roles = stack.cpu_roles()
            pids = {
                role: pid
                for role, pid in roles.items()
                if role in ("control", "api") or role.startswith("engine-")
            }
            (work / "profile").mkdir()
            spies = start_profilers(pids, work / "profile")
            time.sleep(1)  # py-spy attaches before the run starts
            log("request rate: one more Freight run under py-spy")
            try:
                profiled = stack.run_jobs([(stack.tenants[0], files[0])])
            finally:
                profile = stop_profilers(spies)
            profile["run"] = rate_cell(profiled, args.requests)
            profile["note"] = (
                f"py-spy record --rate {PROFILE_RATE} --nonblocking on each process (threads of the "
                "Python side only; vLLM's own processes are not sampled); the run is slower than the "
                "measured ones by the sampling"
            )
    finally:
        for handle in (*engines.values(), stack, baseline, traced):
            if handle is not None:
                handle.stop()
        if sink is not None:
            sink.stop()
        if baseline_src.exists():
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline_src)], check=False
            )

    paired = paired_ratios(runs)
    ratios = paired["freight_over_engine"]
    value = median(ratios)
    report = {
        "benchmark": "request rate: tiny requests, in-process engine vs Freight end to end (issue #21 s2)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_facts(),
        "workload": {
            "requests": args.requests,
            "prompt": f"{PROMPT_WORDS} random words, unique per request",
            "output_tokens": f"uniform {OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]}, ignore_eos",
            "repeats": args.repeats,
        },
        "settings": {
            "model": str(args.model),
            "dtype": serving_dtype(args.model),
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_bytes": KV_BYTES,
            "enforce_eager": args.eager,
            "freight": freight_settings,
        },
        "code": code,
        "runs": runs,
        "paired_ratios": paired,
        "ratios": {name: median(values) for name, values in paired.items()},
        "targets": targets(value, median(paired.get("freight_over_baseline", []))),
        "profile": profile,
        "tracing": tracing_summary(sink, spans, args.requests),
        "provenance": prov.finish(paired),
        "notes": (
            "requests_per_s = requests / wall_s; an engine's wall is one LLM.chat call (start-up and "
            "warm-up excluded), Freight's from the first upload to the poll that saw the batch "
            "completed with its output file. Ratios are per repeat on the same file, median "
            "reported; freight_over_engine is against the faster engine (core in its own process "
            "or inline) of each repeat. cpu_s_per_1000_requests by process: api, control, beat, engine-* (the "
            "worker's Python side), engine-*/children (vLLM's processes), redis."
        ),
    }
    write_report(args.out, report)
    if args.control_plane:  # the targets live together (bench/README.md)
        merge_into_control_plane(report, args.out, Path(args.control_plane))
    log(f"written {args.out}: freight_over_engine {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
