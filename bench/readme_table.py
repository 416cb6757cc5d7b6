"""The README's benchmark table, written from the result files' ``targets`` and nothing else.

``python -m bench.readme_table`` prints the table; ``--write`` (``make bench-table``) puts it
into README.md between the marker comments below. tests/test_docs.py checks that the README holds
exactly what this writes, so a figure, bound, pass or machine in the table is always the result
file's. ROWS is the only hand-written part: which target of which file a row shows, its label,
how many decimals its value is given with, and for the estimate target which pass is quoted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.provenance import REPO, RESULTS_DIR

README = REPO / "README.md"
BEGIN = "<!-- benchmark table: written by `make bench-table` (bench/readme_table.py) from bench/results -->"
END = "<!-- end of the benchmark table -->"
HEADER = (
    "| target | bound | latest | pass | machine, date | `bench/results/` file: `targets` key |\n"
    "|---|---|---|---|---|---|"
)
AT_THE_BOUND = 0.01  # a value passing a <= or >= bound within 1% of it is said to be at the bound
OPS = {"<=": "≤", ">=": "≥", "==": "=", "<": "<", ">": ">"}


@dataclass(frozen=True)
class Row:
    label: str
    file: str
    key: str
    digits: int = 2  # decimals of the value (an int value is shown whole)
    op: str = ""  # the bound's comparison where the file gives none (images, lora: >=)
    section: str = ""  # control_plane.json: the section whose run measured the target (its machine, date)
    note: str = ""  # a figure of the file quoted beside the pass, as "label=dotted.path"
    passes: bool = False  # a target with per-pass figures (estimates): each pass's shown, the quoted first


SCHEDULER = "scheduler.json"
# the scheduler benchmark's workloads (bench/workloads.py), as the table names them, in its order
WORKLOAD_LABELS = {
    "unique": "unique prompts",
    "shared_prefix": "shared prefix (documents x 10 questions)",
    "system_prompts": "20 system prompts",
    "multi_job": "20 batches of 3 tenants, unique prompts",
    "multi_job_shared_prefix": "few-shot jobs of 3 tenants",
    "blend": "blend (8-token classification and 256-token generation over shared prompts)",
    "long_prefix": "long prefix (documents near the context x 20 questions)",
    "dups": "dups (20% exact duplicates, greedy)",
    "request_rate": "request rate (short unique lines, 2 output tokens)",
}
# what each of its target fields is a ratio (or a count) of, in the order the rows give them
FIELD_LABELS = {
    "freight_over_engine": "Freight / the engine on the lines as written",
    "freight_over_runbatch": "Freight / `vllm run_batch`",
    "freight_over_engine_sorted": "Freight (1 job) / the engine on prompt-sorted lines",
    "multi_job_over_engine_sorted": "Freight (6 jobs) / the engine on prompt-sorted lines",
    "freight_over_single_job": "Freight: the jobs / the same lines as one job",
    "freight_tenant_over_single_job": "the same in Freight's default cache mode (`tenant`)",
    "per_tenant_over_single_job_per_tenant": "in the default cache mode (`tenant`): 6 jobs / 1 job per tenant",
    "hit_rate_gap_points": "cache-hit gap to the ideal (points)",
    "freight_over_limit": "Freight / the limit",
    "freight_single_job_over_limit": "Freight (1 job) / the limit",
    "freight_tenant_over_limit": "Freight in the default cache mode (`tenant`) / the limit",
    "freight_per_tenant_1job_over_limit": "`tenant` mode, 1 job per tenant / the limit salted per tenant",
    "freight_per_tenant_over_limit": "`tenant` mode, 6 jobs / the limit salted per tenant",
    "preemptions": "preempted requests",
    "kv_plan_gap_points": "cache-hit gap to KV admission's plan (points)",
}
COUNTS = ("preemptions",)  # shown whole


def scheduler_rows(targets: tuple[str, ...]) -> tuple[Row, ...]:
    """A row per target of the scheduler benchmark (``bench.scheduler.TARGETS``), workload by
    workload, the default KV size before the tight one, fields in FIELD_LABELS' order. The limit
    (bench/against_limit.py) is the engine on the same lines sorted, at its faster core
    placement, or on the lines as written where sorting cannot help (unique, multi_job)."""

    def order(key: str) -> tuple[int, int, int]:
        group, field = key.split(".")
        name = group.removesuffix("_tight_kv")
        return (list(WORKLOAD_LABELS).index(name), group != name, list(FIELD_LABELS).index(field))

    rows = []
    for key in sorted(targets, key=order):
        group, field = key.split(".")
        name = group.removesuffix("_tight_kv")
        label = WORKLOAD_LABELS[name] + (", tight KV" if group != name else "")
        rows.append(
            Row(f"{label}: {FIELD_LABELS[field]}", SCHEDULER, key, digits=0 if field in COUNTS else 2)
        )
    return tuple(rows)


def _scheduler_targets() -> tuple[str, ...]:
    from bench.scheduler import TARGETS

    return tuple(TARGETS)


ROWS = (
    *scheduler_rows(_scheduler_targets()),
    Row(
        "engine steps alone: Freight's engine fed as its loop feeds it / `LLM.chat` on the same lines (engine_step)",
        "engine-step.json",
        "engine_step.freight_over_limit",
        op=">=",
        note="answers decoded by vLLM token by token=ratios.vllm_decode_over_limit",
    ),
    Row(
        "engine settings tuned per workload shape (`freight models tune`): Freight, tuned, / `LLM.chat` "
        "at Freight's previous defaults, the second best of the workloads (tuning)",
        "tuning.json",
        "tuned_over_previous_limit_2nd_best",
        op=">=",
    ),
    Row(
        "the same, the lowest of the workloads",
        "tuning.json",
        "tuned_over_previous_limit_lowest",
        op=">=",
    ),
    Row(
        "20,000 tiny requests: Freight / the faster in-process engine, requests/s",
        "control_plane.json",
        "request_rate_freight_over_engine",
        section="request_rate",
    ),
    Row(
        "the same, in the early-slices run (bench-head-start): Freight / the faster in-process engine",
        "head_start.json",
        "freight_over_engine",
    ),
    Row(
        "the same run: early slices (the first rows run while the rest validates) / the code before them",
        "head_start.json",
        "freight_over_baseline",
        digits=3,
    ),
    Row(
        "validation + planning of a 1,000,000-line batch, two control processes (s)",
        "control_plane.json",
        "validation_1m_s",
        section="validation",
    ),
    Row(
        "finalization of a 1,000,000-request batch on SeaweedFS (s)", "finalization.json", "finalization_1m_s"
    ),
    Row(
        "a 2 GiB file through `/v1/uploads` in 64 MiB parts to SeaweedFS: the API's RSS over idle (MB)",
        "uploads.json",
        "api_rss_increase_mb",
        digits=1,
    ),
    Row(
        "a 1,000,000-line output file downloaded in input order from SeaweedFS: the API's RSS over idle (MB)",
        "input_order.json",
        "input_order_api_rss_increase_mb",
        digits=1,
        note="seconds=stores.s3.seconds",
    ),
    Row(
        "dispatcher tick under 1,000 simulated workers, max (s)",
        "control_plane.json",
        "dispatcher_tick_s",
        section="dispatcher",
    ),
    Row(
        "runnable to claimed, p99 (s)", "control_plane.json", "runnable_to_claim_p99_s", section="dispatcher"
    ),
    Row(
        "fairness between tenants of equal priority: Jain's index of the worst minute",
        "control_plane.json",
        "jain_index",
        section="dispatcher",
    ),
    Row(
        "batches with none of their units on a worker for over 120 s",
        "control_plane.json",
        "starved_batches",
        section="dispatcher",
    ),
    Row(
        "a model's refill pass after a pack is taken, 10M requests: CPU / the revision before",
        "refill_pass.json",
        "refill_pass_cpu_over_baseline",
    ),
    Row("the same, wall time / the revision before", "refill_pass.json", "refill_pass_wall_over_baseline"),
    Row(
        "embeddings, 20,000 inputs: Freight / `vllm run_batch` (inputs/s)",
        "embeddings.json",
        "inputs_freight_over_runbatch",
    ),
    Row(
        "embeddings, 20,000 inputs: Freight / `vllm run_batch` (tokens/s)",
        "embeddings.json",
        "tokens_freight_over_runbatch",
    ),
    Row(
        "dry-run estimates: input tokens exact, share of runs",
        "estimates.json",
        "estimate_input_tokens_exact",
        digits=1,
    ),
    Row(
        "dry-run estimates: metered cost / estimate, worst factor of the last pass (the first beside it)",
        "estimates.json",
        "estimate_cost_worst_factor",
        passes=True,
    ),
    Row(
        "images in chat, 2,000 lines over 50 images: Freight / `LLM.chat` on Freight's order",
        "images.json",
        "freight_vs_llm_chat_sorted",
        op=">=",
    ),
    Row(
        "the same in Freight's default cache mode (`tenant`)",
        "images.json",
        "freight_tenant_vs_llm_chat_sorted",
        op=">=",
    ),
    Row(
        "the same: Freight / `vllm run_batch` on the file as written",
        "images.json",
        "freight_vs_runbatch",
        op=">=",
    ),
    Row(
        "8 LoRA adapters x 250 lines in 4 jobs: Freight / engine with LoRA on Freight's order",
        "lora.json",
        "freight_vs_engine_lora",
        op=">=",
    ),
    Row(
        "the same in Freight's default cache mode (`tenant`)",
        "lora.json",
        "freight_tenant_vs_engine_lora",
        op=">=",
    ),
    Row(
        "the same: Freight / `vllm run_batch` per adapter in turn",
        "lora.json",
        "freight_vs_runbatch_per_adapter",
        op=">=",
    ),
    Row(
        "INT4 (round-to-nearest) / BF16, held-out perplexity of the trained demo model",
        "int4_quality.json",
        "int4_rtn_perplexity_over_bf16",
        digits=4,
    ),
    Row(
        "INT4 (GPTQ) / BF16, held-out perplexity of the trained demo model",
        "int4_quality.json",
        "int4_gptq_perplexity_over_bf16",
        digits=4,
    ),
)
# targets a file holds as a copy of another file's row: bench/finalization.py merges its target
# into control_plane.json too, from the same run
COPIES = {("control_plane.json", "finalization_1m_s"): "finalization.json"}
OPTIONAL = {"input_order.json"}  # rows of a benchmark whose first result may not be committed yet


def _dig(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _number(value: Any, digits: int) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def bound_of(target: dict[str, Any], op: str = "") -> tuple[str, float | bool]:
    """(comparison, bound) of a target in any of the forms the result files hold: ``bound`` and
    ``op``; ``min`` or ``max``; ``bound`` as text (">= 1.2", "<= 1.5 (pass 2: ...)", "true")."""
    bound = target.get("bound")
    if isinstance(bound, str):
        if bound == "true":
            return "==", True
        m = re.match(r"(<=|>=|==|<|>)\s*(-?[\d.]+)", bound)
        if not m:
            raise ValueError(f"a bound this table cannot read: {bound!r}")
        return m.group(1), float(m.group(2))
    if bound is None:
        bound, op = (target["min"], ">=") if "min" in target else (target["max"], "<=")
    return target.get("op") or op, bound


def _bound_text(target: dict[str, Any], op: str) -> str:
    comparison, bound = bound_of(target, op)
    if not comparison:
        raise ValueError(f"no comparison for bound {bound} ({target})")
    if isinstance(bound, bool):
        return f"{OPS[comparison]} {str(bound).lower()}"
    raw = re.match(r"\S+\s*(-?[\d.]+)", target["bound"]) if isinstance(target.get("bound"), str) else None
    return f"{OPS[comparison]} {raw.group(1) if raw else f'{bound:g}'}"


def _verdict(target: dict[str, Any], op: str) -> str:
    if not target.get("pass"):
        return "**no**"
    comparison, bound = bound_of(target, op)
    value = target.get("value")
    if comparison not in ("<=", ">="):
        return "yes"
    near = (
        isinstance(value, float)
        and isinstance(bound, float)
        and bound
        and abs(value / bound - 1) < AT_THE_BOUND
    )
    return "yes, at the bound" if near else "yes"


def _machine_and_date(*sources: dict[str, Any]) -> str:
    """'BF16'/'AVX2' (how the host serves models: AVX-512 BF16 or not) and the run's date, from the
    first source that records each (the run's provenance, then the older fields)."""
    machine = date = None
    for source in sources:
        prov = source.get("provenance") or {}
        facts = prov.get("machine") or source.get("machine") or {}
        flags = facts.get("cpu_flags") if isinstance(facts.get("cpu_flags"), dict) else facts
        if machine is None and isinstance(flags, dict) and "avx512_bf16" in flags:
            machine = "BF16" if flags["avx512_bf16"] else "AVX2"
        for field in (
            prov.get("finished_at"),
            source.get("generated_at"),
            source.get("finished_at"),
            source.get("at"),
        ):
            if date is None and isinstance(field, str) and field:
                date = field[:10]
        if date is None and isinstance(source.get("started_at"), int):
            date = time.strftime("%Y-%m-%d", time.gmtime(source["started_at"]))
    return f"{machine or 'machine not recorded'}, {date or 'date not recorded'}"


def _estimate_passes(data: dict[str, Any], target: dict[str, Any]) -> dict[str, float | None]:
    """Each pass's worst cost factor: the target's own record of them, else (files written
    before it kept them) computed from the file's runs the way bench/estimates.py computes it."""
    if target.get("passes"):
        return dict(target["passes"])
    from bench.estimates import cost_worst_factor

    passes = sorted({r["pass"] for r in data["runs"]})
    return {str(n): cost_worst_factor(data["runs"], n) for n in passes}


def render_row(row: Row, data: dict[str, Any]) -> str:
    target = data["targets"][row.key]
    value, bound = _number(target["value"], row.digits), _bound_text(target, row.op)
    verdict = _verdict(target, row.op)
    if row.passes:
        passes = _estimate_passes(data, target)
        quoted = str(target.get("quoted_pass") or max(passes, key=int))
        _, limit = bound_of(target, row.op)
        others = [
            f"pass {n}: {_number(v, row.digits)}" + ("" if v is not None and v <= limit else ", **no**")
            for n, v in passes.items()
            if n != quoted
        ]
        value = f"{value} (pass {quoted}; {'; '.join(others)})"
    if row.note:
        name, path = row.note.split("=", 1)
        verdict += f" ({name} {_number(_dig(data, path), row.digits)})"
    sources = [data[row.section], data] if row.section else [data]
    return (
        f"| {row.label} | {bound} | {value} | {verdict} | {_machine_and_date(*sources)} | "
        f"`{row.file}`: `{row.key}` |"
    )


def render(results: Path = RESULTS_DIR) -> str:
    """The table, header and rows, from the result files in ``results``."""
    lines = [HEADER]
    read: dict[str, dict[str, Any]] = {}

    def load(name: str) -> dict[str, Any]:
        if name not in read:
            read[name] = json.loads((results / name).read_text())
        return read[name]

    for row in ROWS:
        path = results / row.file
        if row.file in OPTIONAL and not path.exists():
            continue
        if row.file == SCHEDULER:
            row = dataclasses.replace(row, file=latest_run(results, row.key, load))
        lines.append(render_row(row, load(row.file)))
    return "\n".join(lines)


def latest_run(results: Path, key: str, load: Callable[[str], dict[str, Any]]) -> str:
    """The scheduler benchmark's file with the latest figure for target ``key``: the full run's
    (``scheduler.json``) unless a later run of some of its workloads measured it again (the table
    quotes each target's latest figure; a smoke run's, ``--quick``, is none)."""
    best, best_date = SCHEDULER, ""
    for path in sorted(results.glob("scheduler*.json")):
        if _family(path.name) != _family(SCHEDULER):
            continue
        data = load(path.name)
        target = (data.get("targets") or {}).get(key)
        if data.get("quick") or not isinstance(target, dict) or target.get("value") is None:
            continue
        if data.get("generated_at", "") > best_date:
            best, best_date = path.name, data.get("generated_at", "")
    return best


def _family(name: str) -> str:
    """The benchmark a result file is of: ``scheduler-cache-modes.json`` -> ``scheduler``."""
    return name.removesuffix(".json").split("-", 1)[0]


def unmapped(results: Path = RESULTS_DIR, files: tuple[str, ...] = ()) -> list[str]:
    """``file: key`` of each target of ``files`` (the table's files by default) without a row. A
    target a row shows from another file of the same benchmark counts as shown (the table quotes
    the latest run of it), and one without a value was not measured by that file's run (a run of
    some workloads writes the others' targets empty)."""
    shown = {(r.file, r.key) for r in ROWS} | set(COPIES)
    shown_in_family = {(_family(r.file), r.key) for r in ROWS}
    names = files or tuple(sorted({r.file for r in ROWS}))
    out = []
    for name in names:
        if (results / name).exists():
            keys = json.loads((results / name).read_text()).get("targets") or {}
            out += [
                f"{name}: {k}"
                for k, target in keys.items()
                if (name, k) not in shown
                and (_family(name), k) not in shown_in_family
                and not (isinstance(target, dict) and target.get("value") is None)
            ]
    return out


def readme_table(text: str) -> str:
    """The table between the markers of README text."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the table into README.md")
    args = parser.parse_args(argv)
    table = render()
    if not args.write:
        print(table)
        return 0
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    print(f"README.md: {len(ROWS)} rows written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
