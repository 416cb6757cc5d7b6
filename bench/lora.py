"""LoRA benchmark (issue #47 part 2): many teams' adapters of one base model, packed on one engine.

    python -m bench.lora [--repeats 3] [--out FILE]
    python -m bench.lora --quick --out /tmp/lora-quick.json     # 3 adapters x 20 lines: the plumbing

The workload: 8 LoRA adapters of the demo model x 250 chat lines each (2,000), shuffled together
and cut into 4 jobs of 500 lines of 3 tenants, as teams sharing a fleet would send them. Every
line is one of TEMPLATES system prompts (~TEMPLATE_TOKENS tokens) and a short user message of its
own, so an adapter's lines share prefixes; greedy, exactly OUTPUT_TOKENS output tokens (max_tokens
= min_tokens, ignore_eos), fresh texts per repeat. Two adapters are ``make adapters``' trained
``alpha`` and ``beta`` (models/adapters); the other six are untrained LoRAs of the same shape
(rank 8 on every projection, random weights, ``random_adapter``), which cost the engine the same
arithmetic as trained ones: this measures speed, not answers.

Systems, each on every repeat's lines, at the same limits (demo model, dtype, max_num_seqs, KV
cache bytes, max_model_len, max_num_batched_tokens, prefix caching, compiled):

  freight       the live stack (bench/freight_runner.py), the adapters registered with
                ``freight models add-adapter`` and the engine worker restarted to serve them (an
                operator's steps), warm; the 4 jobs submitted together with the official
                ``openai`` client; wall time from the first upload to the poll that saw the last
                batch completed with its output file. FREIGHT_PREFIX_CACHE_SHARING=global, against
                engine_lora on the global order (no salts).
  freight_tenant  a second warm stack, the same in Freight's default cache mode (tenant: each
                tenant's prefixes its own), in the same rotation: the isolation's cost is
                tenant_over_global (its throughput over freight's, per repeat), and
                freight_tenant_vs_engine_lora is the default mode's target (>= 0.95x), against
                engine_lora_tenant.
  engine_lora   vLLM's engine in-process (bench/lora_engine.py), LoRA on with the limits Freight's
                worker takes (workers.lora.lora_engine_args over the registry's adapters), stats
                logging off, one ``LLM.chat`` on all lines sorted the way Freight sorts them
                (scheduler.ordering's prompt_key and adapter_key over the rendered prompt). Engine
                start-up excluded, as Freight's is (a warm stack); run with the engine core in a
                process of its own and inline (bench/request_rate.py's two placements) and the
                faster one of each repeat counts. Target: Freight >= 0.95x.
  engine_lora_tenant  the same warm engine on the lines as Freight's tenant mode runs them (issue
                #51 part 1's limit for that mode): by tenant, then sorted as above, each with its
                tenant's ``cache_salt`` (``LLM.generate`` on the chat template's token ids, the
                rendering on the clock, bench/engine_baseline.py's way with salts).
  engine_base   the same engine without LoRA on the same lines (every line the base model),
                sorted by prompt: what LoRA costs against the base model alone (no target).
  runbatch      what a team does today: for each adapter in turn, ``python -m
                vllm.entrypoints.openai.run_batch --enable-lora --lora-modules NAME=PATH`` on its
                250 lines, timed as whole processes (engine start included), one after another;
                the sum. Target: Freight >= 3x. Run on the first --runbatch-repeats repeats only
                (it is most of the benchmark's time and far from its bound).

Idle systems are paused (SIGSTOP, bench/freeze.py) while one is measured; the order rotates per
repeat. Ratios are throughput ratios (every system makes the same output tokens) per repeat,
median reported.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.provenance import STACK, Run, machine_facts
from bench.scheduler import REPO, RESULTS_DIR, WORK_DIR, log, serving_dtype, write_report

MODEL_DIR = Path("models/demo")
TRAINED = ("alpha", "beta")  # infra/build_lora_adapters.py's, in models/adapters
ADAPTERS = 8
LINES_PER_ADAPTER = 250
JOBS = 4
TEMPLATES = 4
TEMPLATE_TOKENS = 200
USER_TOKENS = 30
OUTPUT_TOKENS = 16
QUICK = {"adapters": 3, "lines_per_adapter": 20, "repeats": 1}  # one untrained adapter too
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's LLMEngine default on CPU: what Freight's engine gets
MAX_MODEL_LEN = 2048
KV_BYTES = 256 * 1024**2
BASE = wl.MODEL_NAME  # the stack serves the demo model as "demo" (FREIGHT_MODELS)
ENGINE_CORES = {"process": {}, "inline": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
TARGETS = {
    "freight_vs_engine_lora": 0.95,
    "freight_vs_runbatch_per_adapter": 3.0,
    "freight_tenant_vs_engine_lora": 0.95,  # the same in Freight's default cache mode
}
CACHE_MODES = {"freight": "global", "freight_tenant": "tenant"}  # system -> FREIGHT_PREFIX_CACHE_SHARING


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (
    *STACK,
    "bench/lora.py",
    "bench/lora_engine.py",
    "bench/engine_baseline.py",
    "bench/runbatch_baseline.py",
    "bench/freight_runner.py",
)


def adapter_name(i: int) -> str:
    return f"lora-{TRAINED[i]}" if i < len(TRAINED) else f"lora-random-{i}"


# ------------------------------------------------------------------------------------- adapters


def random_adapter(base_dir: Path, out_dir: Path, seed: int) -> Path:
    """An untrained LoRA of the trained adapters' shape (infra/build_lora_adapters.py's rank, alpha
    and target modules), its A and B both random (seeded) so its term is not zero: the engine's
    work per token is a trained adapter's. Kept if already built."""
    if (out_dir / "adapter_config.json").exists():
        return out_dir
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from infra.build_lora_adapters import ALPHA, RANK, TARGETS

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.02)
    tmp = out_dir.with_name(out_dir.name + ".build")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.rename(out_dir)
    return out_dir


def prepare_adapters(base_dir: Path, count: int, random_dir: Path) -> dict[str, Path]:
    """``count`` adapters by name: the two trained ones (built if missing), then random ones."""
    from infra.build_lora_adapters import build

    trained = build(base_dir, REPO / "models" / "adapters")
    out: dict[str, Path] = {}
    for i in range(count):
        path = (
            trained[i] if i < len(trained) else random_adapter(base_dir, random_dir / f"random-{i}", seed=i)
        )
        out[adapter_name(i)] = path
    return out


# ------------------------------------------------------------------------------------- workload


def lines(tokenizer: Any, adapters: list[str], per_adapter: int, seed: int | str) -> list[dict[str, Any]]:
    """``per_adapter`` chat lines of each adapter, shuffled together (seeded, fresh per seed): each
    a system prompt of one of TEMPLATES and a user message of its own."""
    rng = random.Random(f"lora-{seed}")
    templates = [wl.text_of_tokens(rng, tokenizer, TEMPLATE_TOKENS) for _ in range(TEMPLATES)]
    out = []
    for name in adapters:
        for i in range(per_adapter):
            messages = [
                {"role": "system", "content": rng.choice(templates)},
                {"role": "user", "content": wl.text_of_tokens(rng, tokenizer, USER_TOKENS)},
            ]
            line = wl.request_line(f"{name}-{seed}-{i:04d}", messages, OUTPUT_TOKENS)
            line["body"]["model"] = name
            out.append(line)
    rng.shuffle(out)
    return out


def split_jobs(all_lines: list[dict[str, Any]], jobs: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """The lines cut into ``jobs`` consecutive jobs of (nearly) equal size, tenants round-robin."""
    size = -(-len(all_lines) // jobs)
    return [(wl.TENANTS[j % len(wl.TENANTS)], all_lines[j * size : (j + 1) * size]) for j in range(jobs)]


def freight_order(tokenizer: Any, all_lines: list[dict[str, Any]], base: str = BASE) -> list[dict[str, Any]]:
    """The lines in the order Freight's validation sorts them: by prompt key (the rendered prompt's
    first FREIGHT_SORT_KEY_TOKENS token ids, scheduler.ordering.prompt_key), an adapter's lines
    after its marker (scheduler.ordering.adapter_key); the line number breaks ties, as in Freight."""
    from scheduler.ordering import adapter_key, prompt_key
    from storage.settings import Settings

    key_tokens = Settings.from_env({}).sort_key_tokens  # Freight's default

    def key(item: tuple[int, dict[str, Any]]) -> tuple[bytes, int]:
        i, line = item
        plain = prompt_key(wl.prompt_token_ids(tokenizer, line), key_tokens)
        model = line["body"]["model"]
        return (plain if model == base else adapter_key(model, plain)), i

    return [line for _, line in sorted(enumerate(all_lines), key=key)]


def tenant_order(tokenizer: Any, jobs: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The limit of Freight's default cache mode (issue #51 part 1): the lines by tenant (in
    wl.TENANTS' order), then as Freight sorts them, each carrying its tenant's ``cache_salt`` (a
    tenant's prefixes are its own in the engine's cache, as in Freight's tenant mode)."""
    out: list[dict[str, Any]] = []
    for tenant in wl.TENANTS:
        mine = [line for owner, job in jobs if owner == tenant for line in job]
        out += [
            {**line, "body": {**line["body"], "cache_salt": tenant}}
            for line in freight_order(tokenizer, mine)
        ]
    return out


def as_base(all_lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same lines, every one the base model's."""
    return [{**line, "body": {**line["body"], "model": BASE}} for line in all_lines]


def by_adapter(all_lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each adapter's lines in the order the jobs hold them: a team's file for run_batch."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in all_lines:
        out.setdefault(line["body"]["model"], []).append(line)
    return out


# ---------------------------------------------------------------------------------------- ratios


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def fastest(*runs: dict[str, Any] | None) -> float | None:
    """The shorter wall of the runs without errors (the faster engine placement)."""
    walls = [r["wall_s"] for r in runs if r and not r.get("errors") and r.get("wall_s")]
    return min(walls) if walls else None


def paired_ratios(repeats: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Throughput ratios per repeat (walls inverted: every system makes the same tokens); a repeat
    where a side failed or did not run counts for none."""
    out: dict[str, list[float]] = {
        "freight_vs_engine_lora": [],
        "freight_vs_runbatch_per_adapter": [],
        "engine_lora_vs_engine_base": [],
        "freight_vs_engine_base": [],
        "freight_tenant_vs_engine_lora": [],  # against the engine on the tenant order, salted
        "tenant_over_global": [],  # the isolation's cost: tenant mode's throughput over global's
    }
    for cells in repeats:
        freight = fastest(cells.get("freight"))
        tenant = fastest(cells.get("freight_tenant"))
        lora = fastest(cells.get("engine_lora_process"), cells.get("engine_lora_inline"))
        lora_tenant = fastest(cells.get("engine_lora_tenant_process"), cells.get("engine_lora_tenant_inline"))
        base = fastest(cells.get("engine_base_process"), cells.get("engine_base_inline"))
        runbatch = fastest(cells.get("runbatch"))
        for name, theirs, mine in (
            ("freight_vs_engine_lora", lora, freight),
            ("freight_vs_runbatch_per_adapter", runbatch, freight),
            ("engine_lora_vs_engine_base", base, lora),
            ("freight_vs_engine_base", base, freight),
            ("freight_tenant_vs_engine_lora", lora_tenant, tenant),
            ("tenant_over_global", freight, tenant),
        ):
            if theirs and mine:
                out[name].append(theirs / mine)
    return out


def targets(ratios: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    return {
        name: {"value": ratios.get(name), "bound": bound, "pass": (ratios.get(name) or 0) >= bound}
        for name, bound in TARGETS.items()
    }


# ------------------------------------------------------------------------------------ the systems


def freight_stack(
    work: Path, model: Path, adapters: dict[str, Path], warm: list[Path], eager: bool, system: str = "freight"
) -> Any:
    """A warm Freight stack serving the adapters: started, the adapters registered with the CLI,
    the engine worker restarted (it starts with LoRA on when its base has adapters), the adapter
    warm-up jobs run. ``system`` names its cache mode (CACHE_MODES) and its folder."""
    from bench.freight_runner import FreightStack
    from infra.processes import FREIGHT, engine_names

    sharing = {"FREIGHT_PREFIX_CACHE_SHARING": CACHE_MODES[system]}
    stack = FreightStack(
        work / system, model, max_num_seqs=MAX_NUM_SEQS, kv_cache_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN,
        enforce_eager=eager, tenants=wl.TENANTS, extra_env=sharing,
    ).start()  # fmt: skip
    try:
        for name, path in adapters.items():
            subprocess.run(
                [*FREIGHT, "models", "add-adapter", BASE, name, "--path", str(path)],
                cwd=REPO, env=stack.env, check=True, capture_output=True, text=True,
            )  # fmt: skip
        (worker,) = engine_names(BASE, 1)
        stack.stack.restart(worker)
        for i, path in enumerate(warm):
            result = stack.run_jobs([(wl.TENANTS[i % len(wl.TENANTS)], path)], timeout=1800)
            if result["errors"]:
                raise RuntimeError(f"adapter warm-up failed: {result}")
    except BaseException:
        stack.stop()
        raise
    return stack


def freight_lora_limits(stack: Any) -> dict[str, Any]:
    """The LoRA engine arguments Freight's worker took for the registered adapters."""
    from storage.adapters import adapters
    from storage.db import Database
    from workers.lora import lora_engine_args

    db = Database(stack.stack.settings.database_url)
    try:
        return lora_engine_args(adapters(db, BASE))
    finally:
        db.dispose()


def served_by_wrong_model(stack: Any, batch_ids: list[str]) -> int:
    """Output lines whose response names another model than the line's adapter (custom_id
    ``ADAPTER-SEED-N``): a line served by the wrong adapter, or by the base."""
    wrong = 0
    for tenant in wl.TENANTS:
        client = stack.client(tenant)
        for batch in client.batches.list(limit=100).data:
            if batch.id not in batch_ids or not batch.output_file_id:
                continue
            for raw in client.files.content(batch.output_file_id).text.splitlines():
                if raw.strip():
                    line = json.loads(raw)
                    body = (line.get("response") or {}).get("body") or {}
                    wrong += body.get("model") != line["custom_id"].rsplit("-", 2)[0]
    return wrong


def engine_argv(
    model: Path, eager: bool, lora: dict[str, Any] | None, adapters: dict[str, Path]
) -> list[str]:
    argv = [
        "--model", str(model), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-bytes", str(KV_BYTES), "--dtype", serving_dtype(model),
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip
    if lora:
        argv += [a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]
        argv += ["--max-loras", str(lora["max_loras"]), "--max-lora-rank", str(lora["max_lora_rank"])]
        argv += ["--max-cpu-loras", str(lora["max_cpu_loras"])]
    return argv


def run_per_adapter(
    files: dict[str, Path], adapters: dict[str, Path], model: Path, eager: bool, rank: int, out_dir: Path
) -> dict[str, Any]:
    """run_batch on each adapter's file in turn, each a whole process with the adapter enabled."""
    from bench import runbatch_baseline

    runs = {}
    for name, path in files.items():
        log(f"lora: run_batch for {name}")
        runs[name] = runbatch_baseline.run(
            path, out_dir / name, model=str(model), served_model_name=BASE, max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=KV_BYTES, enforce_eager=eager, dtype=serving_dtype(model),
            extra=["--enable-lora", "--lora-modules", f"{name}={adapters[name]}", "--max-lora-rank", str(rank)],
        )  # fmt: skip
    keys = ("wall_s", "requests", "prompt_tokens", "output_tokens", "errors")
    total: dict[str, Any] = {k: sum(r.get(k) or 0 for r in runs.values()) for k in keys}
    total["cached_tokens"] = sum(r.get("cached_tokens") or 0 for r in runs.values())
    total["per_adapter"] = {
        name: {k: r.get(k) for k in (*keys, "busy_s", "cached_tokens", "command")} for name, r in runs.items()
    }
    return total


def cell(run: dict[str, Any]) -> dict[str, Any]:
    """A measured run with its output tokens/s."""
    wall, tokens = run.get("wall_s"), run.get("output_tokens")
    return {**run, "output_tok_s": tokens / wall if wall and tokens else None}


def write_warmup(
    tokenizer: Any, names: list[str], per_adapter: int, work: Path
) -> tuple[list[Path], Path, Path]:
    """Warm-up files of a quarter of the measured lines (at least 8 an adapter), on other templates
    than any repeat's, so every system has run batches of the measured shape before the clock
    runs: Freight's as 2 jobs, the LoRA engine's and the base engine's sorted as Freight sorts them."""
    warm_lines = lines(tokenizer, names, max(8, per_adapter // 4), "warm")
    warm_jobs = []
    for j, (_, job) in enumerate(split_jobs(warm_lines, 2)):
        warm_jobs.append(work / f"warm-{j}.jsonl")
        wl.write_jsonl(warm_jobs[-1], job)
    warm_lora, warm_base = work / "warm-sorted.jsonl", work / "warm-base.jsonl"
    wl.write_jsonl(warm_lora, freight_order(tokenizer, warm_lines))
    wl.write_jsonl(warm_base, freight_order(tokenizer, as_base(warm_lines)))
    return warm_jobs, warm_lora, warm_base


def write_repeats(
    tokenizer: Any, names: list[str], args: argparse.Namespace, work: Path
) -> list[dict[str, Any]]:
    """Each repeat's files: Freight's jobs (tenant, path), the engines' sorted files (``lora``,
    ``base``) and run_batch's file per adapter (``per_adapter``)."""
    files: list[dict[str, Any]] = []
    for r in range(args.repeats):
        rep = work / f"r{r}"
        rep.mkdir()
        these = lines(tokenizer, names, args.lines_per_adapter, r)
        jobs = []
        split = split_jobs(these, args.jobs)
        for j, (tenant, job) in enumerate(split):
            wl.write_jsonl(rep / f"job-{j}.jsonl", job)
            jobs.append((tenant, rep / f"job-{j}.jsonl"))
        wl.write_jsonl(rep / "lora-sorted.jsonl", freight_order(tokenizer, these))
        wl.write_jsonl(rep / "lora-tenant-sorted.jsonl", tenant_order(tokenizer, split))
        wl.write_jsonl(rep / "base-sorted.jsonl", freight_order(tokenizer, as_base(these)))
        per_adapter = {}
        for name, group in by_adapter([line for _, p in jobs for line in wl.read_jsonl(p)]).items():
            per_adapter[name] = rep / f"adapter-{name}.jsonl"
            wl.write_jsonl(per_adapter[name], group)
        files.append(
            {
                "jobs": jobs,
                "lora": rep / "lora-sorted.jsonl",
                "lora_tenant": rep / "lora-tenant-sorted.jsonl",
                "base": rep / "base-sorted.jsonl",
                "per_adapter": per_adapter,
            }
        )
    return files


def measure(systems: dict[str, Any], these: dict[str, Any], r: int, runbatch: Any) -> dict[str, Any]:
    """One repeat: every warm system in turn (the first one rotating), the others paused, then
    run_batch per adapter (``runbatch``: a callable, or None where this repeat skips it)."""
    roles = list(systems)
    cells: dict[str, Any] = {}
    for role in roles[r % len(roles) :] + roles[: r % len(roles)]:
        log(f"lora: repeat {r + 1}: {role}")
        handle = systems[role]
        handle.resume()
        try:
            if role in CACHE_MODES:
                run = handle.run_jobs(these["jobs"])
                # read before the stack is paused (it answers nothing then), off the clock
                run["served_by_wrong_model"] = served_by_wrong_model(handle, run["batch_ids"])
                run["errors"] += run["served_by_wrong_model"]
            else:
                run = handle.run(these[role.split("_")[1]])
                if role.startswith("engine_lora_"):  # the default cache mode's limit, same engine
                    cells[role.replace("engine_lora_", "engine_lora_tenant_")] = cell(
                        handle.run(these["lora_tenant"])
                    )
        finally:
            handle.pause()
        cells[role] = cell(run)
    if runbatch is not None:
        log(f"lora: repeat {r + 1}: runbatch, one adapter at a time")
        cells["runbatch"] = cell(runbatch(these["per_adapter"], r))
    return cells


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=ADAPTERS)
    parser.add_argument("--lines-per-adapter", type=int, default=LINES_PER_ADAPTER)
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runbatch-repeats", type=int, default=1, help="repeats that also run run_batch")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--eager", action="store_true", help="enforce_eager in every system")
    parser.add_argument("--quick", action="store_true", help="3 adapters x 20 lines, one repeat")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "lora.json")
    args = parser.parse_args(argv)
    prov = Run("bench.lora", MEASURES, argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)

    from bench.engine_baseline import EngineServer

    started = time.monotonic()
    work = WORK_DIR / "lora"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log(
        f"lora: {args.adapters} adapters x {args.lines_per_adapter} lines in {args.jobs} jobs, {args.repeats} repeats"
    )
    adapters = prepare_adapters(args.model, args.adapters, WORK_DIR / "lora-adapters")
    names = list(adapters)
    tokenizer = wl.load_tokenizer(args.model)

    warm_jobs, warm_lora, warm_base = write_warmup(tokenizer, names, args.lines_per_adapter, work)
    files = write_repeats(tokenizer, names, args, work)
    workload = wl.describe(tokenizer, wl.read_jsonl(files[0]["lora"]))

    systems: dict[str, Any] = {}
    repeats: list[dict[str, Any]] = []
    lora_limits: dict[str, Any] = {}
    freight_settings: dict[str, Any] = {}
    engine_facts: dict[str, Any] = {}
    try:
        for system, sharing in CACHE_MODES.items():
            log(f"lora: starting a Freight stack ({system}, {sharing} cache sharing) with the adapters")
            stack = systems[system] = freight_stack(work, args.model, adapters, warm_jobs, args.eager, system)
            freight_settings[system] = stack.settings()
            lora_limits = lora_limits or freight_lora_limits(stack)
            stack.pause()
        for kind, warm in (("lora", warm_lora), ("base", warm_base)):
            for core, env in ENGINE_CORES.items():
                role = f"engine_{kind}_{core}"
                log(f"lora: starting the in-process engine ({role})")
                argv = [*engine_argv(args.model, args.eager, lora_limits if kind == "lora" else None, adapters),
                        "--warmup-file", str(warm)]  # fmt: skip
                systems[role] = EngineServer(argv, work / f"{role}.log", env, module="bench.lora_engine")
                engine_facts[role] = systems[role].facts
                systems[role].pause()
        rank = int(lora_limits["max_lora_rank"])

        def runbatch(per_adapter: dict[str, Path], r: int) -> dict[str, Any]:
            return run_per_adapter(
                per_adapter, adapters, args.model, args.eager, rank, work / f"runbatch-{r}"
            )

        for r, these in enumerate(files):
            repeats.append(measure(systems, these, r, runbatch if r < args.runbatch_repeats else None))
    finally:
        for handle in systems.values():
            handle.stop()

    paired = paired_ratios(repeats)
    ratios = {name: median(values) for name, values in paired.items()}
    report: dict[str, Any] = {
        "benchmark": "LoRA: adapters of one base packed on one engine, Freight end to end vs vLLM (issue #47 part 2)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_facts(),
        "provenance": prov.finish(paired),
        "workload": {
            "adapters": {name: str(path) for name, path in adapters.items()},
            "trained_adapters": [n for n in names if not n.startswith("lora-random-")],
            "untrained_adapters": "rank-8 LoRAs of the trained ones' shape, A and B random (normal, std 0.02)",
            "lines_per_adapter": args.lines_per_adapter,
            "jobs": args.jobs,
            "tenants": list(wl.TENANTS),
            "templates": TEMPLATES,
            "template_tokens": TEMPLATE_TOKENS,
            "user_tokens": USER_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "repeats": args.repeats,
            "runbatch_repeats": min(args.runbatch_repeats, args.repeats),
            "first_repeat": workload,
        },
        "settings": {
            "model": str(args.model),
            "dtype": serving_dtype(args.model),
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_bytes": KV_BYTES,
            "enforce_eager": args.eager,
            "lora": lora_limits,
            "engines": engine_facts,
            "freight": freight_settings,
        },
        "runs": repeats,
        "paired_ratios": paired,
        "ratios": ratios,
        "targets": targets(ratios),
        "notes": (
            "Ratios are throughput ratios (the other system's wall over Freight's; every system makes "
            "the same output tokens), per repeat, median reported. freight_vs_engine_lora: against "
            "the faster engine placement (core in a process of its own or inline) of each repeat, "
            "both on the lines sorted as Freight sorts them, engine start-up and warm-up excluded "
            "(Freight's stack is warm too). freight_vs_runbatch_per_adapter: run_batch once per "
            "adapter on its lines, one after another, whole processes (engine start-up included), "
            "summed. engine_lora_vs_engine_base: the LoRA engine's throughput over the base model's "
            "alone on the same lines (below 1: what LoRA costs; the base also shares prefixes across "
            "adapters, which vLLM's per-adapter prefix cache cannot). Freight runs twice, warm stacks "
            "side by side in the same rotation: freight with FREIGHT_PREFIX_CACHE_SHARING=global and "
            "freight_tenant with the default, tenant; tenant_over_global is the isolation's cost "
            "(freight's wall over freight_tenant's, per repeat) and freight_tenant_vs_engine_lora "
            "the default mode's target."
        ),
    }
    write_report(args.out, report)
    log(f"written {args.out}: {json.dumps(ratios)}")
    return 0 if all(t["pass"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
