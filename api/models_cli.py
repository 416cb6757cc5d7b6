"""``freight models``: the model registry from the command line (add, list, set-engine, remove,
quantize; add-adapter and remove-adapter for LoRA adapters of a base model).

Imported by ``api/cli.py``, which vLLM's engine processes re-import: nothing here may import Flask
at module level (vLLM walks the loaded modules at start-up and trips over Flask's context globals).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from api.cli_settings import command_runtime, command_settings
from storage.adapters import AdapterEntry, adapters
from storage.registry import EMBED, REQUESTED, TASKS, ModelEntry, TunedSettings, applied_tuning
from workers.engine_args import describe
from workers.quantize import METHODS, SCHEMES


class _Bar:
    """A click progress bar fed by (done, total) callbacks, opened on the first one."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: Any = None  # click's ProgressBar, once the total is known
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _echo(message: str) -> None:
    click.echo(message, err=True)


@click.group()
def models() -> None:
    """Register, list, remove and quantize served models."""


@models.command("add")
@click.argument("name")
@click.option("--path", "source", required=True, help="checkpoint directory or s3://bucket/prefix")
@click.option("--quantization", type=click.Choice(REQUESTED), default="auto", show_default=True)
@click.option("--max-model-len", type=int, default=None)
@click.option(
    "--instance-price-per-hour", type=float, default=None, help="$/hour of one engine worker's machine"
)
@click.option("--list-price-in", type=float, default=None, help="list $ per 1M input tokens")
@click.option("--list-price-cached", type=float, default=None, help="list $ per 1M cached input tokens")
@click.option("--list-price-out", type=float, default=None, help="list $ per 1M output tokens")
@click.option("--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
              help="a vLLM engine argument of this model (as `vllm serve --KEY VALUE`); repeat for more")  # fmt: skip
@click.option("--tool-call-parser", default=None, metavar="NAME",
              help='vLLM\'s tool-call parser for this model (as `vllm serve --tool-call-parser`, e.g. hermes): '
              'serves tool_choice "auto"')  # fmt: skip
@click.option("--task", type=click.Choice(("auto", *TASKS)), default="auto", show_default=True,
              help="generate (chat, completions), embed (/v1/embeddings, and scores by cosine) or score (a cross-encoder: "
              "/v1/score, /v1/rerank); auto: from the checkpoint's architecture")  # fmt: skip
def models_add(
    name: str,
    source: str,
    quantization: str,
    max_model_len: int | None,
    engine_args: tuple[str, ...],
    tool_call_parser: str | None,
    task: str,
    **prices: float | None,
) -> None:
    """Register NAME, served from --path (quantized as --quantization says)."""
    from workers.registration import AddRequest, add

    bar = _Bar("quantizing")
    try:
        with command_runtime(command_settings()[0]) as rt:
            entry = add(
                rt,
                AddRequest(
                    name=name,
                    source=source,
                    quantization=quantization,
                    max_model_len=max_model_len,
                    instance_price_per_hour=prices["instance_price_per_hour"],
                    list_price_input=prices["list_price_in"],
                    list_price_cached=prices["list_price_cached"],
                    list_price_output=prices["list_price_out"],
                    engine_args=engine_args,
                    tool_call_parser=tool_call_parser,
                    task=task,
                ),
                echo=_echo,
                progress=bar,
            )
    finally:
        bar.close()
    served = {
        EMBED: " (an embedding model: it serves /v1/embeddings, /v1/score and /v1/rerank)",
        "score": " (a cross-encoder: it serves /v1/score and /v1/rerank)",
        "transcribe": " (a speech model: it serves /v1/audio/transcriptions and /v1/audio/translations)",
    }.get(entry.task, "")
    click.echo(f"registered {entry.name}: {entry.quantization} from {entry.checkpoint}{served}")
    if entry.engine_args or entry.max_model_len:
        click.echo(f"engine args: {describe(_engine_args(entry))}")
    if entry.tool_call_parser:
        click.echo(f"tool-call parser: {entry.tool_call_parser}")


@models.command("set-engine")
@click.argument("name")
@click.option("--engine-arg", "assign", multiple=True, metavar="KEY=VALUE",
              help="set a vLLM engine argument (as `vllm serve --KEY VALUE`); repeat for more")  # fmt: skip
@click.option("--tool-call-parser", default=None, metavar="NAME",
              help='set vLLM\'s tool-call parser (serves tool_choice "auto"); --unset tool_call_parser drops it')  # fmt: skip
@click.option("--unset", multiple=True, metavar="KEY", help="drop one of the model's engine arguments")
def models_set_engine(
    name: str, assign: tuple[str, ...], tool_call_parser: str | None, unset: tuple[str, ...]
) -> None:
    """Set or unset NAME's vLLM engine arguments and tool-call parser; its workers apply them at
    their next start."""
    from workers.registration import set_engine

    with command_runtime(command_settings()[0]) as rt:
        entry = set_engine(rt, name, assign, unset, tool_call_parser)
    args = _engine_args(entry)
    click.echo(
        f"{entry.name} engine args: {describe(args) if args else 'none (the FREIGHT_ENGINE_* defaults)'}"
    )
    click.echo(f"{entry.name} tool-call parser: {entry.tool_call_parser or 'none'}")
    click.echo("restart the model's workers to apply them")


def _engine_args(e: ModelEntry) -> dict:
    """The model's engine arguments, its max_model_len (a column of its own) among them."""
    args = dict(e.engine_args)
    if e.max_model_len is not None:
        args["max_model_len"] = e.max_model_len
    return args


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per model and per adapter")
def models_list(as_json: bool) -> None:
    """The served models: registry rows and FREIGHT_MODELS declarations, then LoRA adapters."""
    from api.services.models import list_adapters, list_models, tenant_names

    with command_runtime(command_settings()[0]) as rt:
        rows = list_models(rt)
        loras = list_adapters(rt, None)
        names = tenant_names(rt)
        tuned = {e.name: applied_tuning(rt.db, e) for e in rows}
    if as_json:
        for e in rows:
            click.echo(json.dumps({**_as_dict(e), "tuned": _tuned_dict(tuned[e.name])}))
        for a in loras:
            click.echo(json.dumps(_adapter_dict(a, names)))
        return
    if not rows:
        click.echo("no models (add one with `freight models add NAME --path DIR`)")
        return
    header = (
        "NAME", "QUANT", "REQUESTED", "SOURCE", "WEIGHTS", "$/H", "LIST IN/OUT", "PROBE INT4/BF16", "TASK", "TUNED",
        "ENGINE ARGS",
    )  # fmt: skip
    _table(header, [_tuned_row(_row(e), tuned[e.name]) for e in rows])
    if loras:
        click.echo("")
        adapter_rows = [
            (a.name, a.base, str(a.rank), ",".join(a.target_modules), _tenants(a, names), a.path)
            for a in loras
        ]
        _table(("ADAPTER", "BASE", "RANK", "TARGET MODULES", "TENANTS", "PATH"), adapter_rows)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _tenants(a: AdapterEntry, names: dict[str, str]) -> str:
    return "all" if a.tenants is None else ",".join(sorted(names.get(t, t) for t in a.tenants))


def _adapter_dict(a: AdapterEntry, names: dict[str, str]) -> dict:
    return {
        "name": a.name,
        "adapter": True,
        "base": a.base,
        "path": a.path,
        "rank": a.rank,
        "target_modules": list(a.target_modules),
        "tenants": None if a.tenants is None else sorted(names.get(t, t) for t in a.tenants),
        "lora_int_id": a.id,
    }


def _row(e: ModelEntry) -> tuple[str, ...]:
    weights = f"{e.weight_bytes / 1e6:.1f} MB" if e.weight_bytes else "-"
    price = "-" if e.instance_price_per_hour is None else f"{e.instance_price_per_hour:g}"
    listed = f"{e.list_price.input:g}/{e.list_price.output:g}" if e.list_price else "-"
    probe = "-"
    if e.probe:
        probe = " ".join(f"b{b}:{r:g}" for b, r in e.probe.get("int4_over_bf16", {}).items())
    source = e.source + (" (FREIGHT_MODELS)" if e.declared else "")
    engine = describe(_engine_args(e)) or "-"
    if e.tool_call_parser:
        engine = f"{engine} tool_call_parser={e.tool_call_parser}".removeprefix("- ")
    return (
        e.name,
        e.quantization,
        e.requested_quantization,
        source,
        weights,
        price,
        listed,
        probe,
        e.task,
        engine,
    )


def _as_dict(e: ModelEntry) -> dict:
    return {
        "name": e.name,
        "source": e.source,
        "checkpoint": e.checkpoint,
        "requested_quantization": e.requested_quantization,
        "quantization": e.quantization,
        "max_model_len": e.max_model_len,
        "instance_price_per_hour": e.instance_price_per_hour,
        "list_price": None if e.list_price is None else vars(e.list_price),
        "parameters": e.parameters,
        "weight_bytes": e.weight_bytes,
        "probe": e.probe,
        "declared": e.declared,
        "engine_args": _engine_args(e),
        "tool_call_parser": e.tool_call_parser,
        "task": e.task,
    }


def _tuned_row(row: tuple[str, ...], t: TunedSettings | None) -> tuple[str, ...]:
    """``row`` with the TUNED column (the applied tuning's shape class and measured gain) before
    ENGINE ARGS, which then also lists the tuned args its explicit ones leave in force, marked."""
    if t is None:
        return (*row[:-1], "-", row[-1])
    engine = row[-1].split() if row[-1] != "-" else []
    explicit = {arg.split("=", 1)[0] for arg in engine}
    tuned = {k: v for k, v in t.engine_args.items() if k not in explicit}
    engine += [f"{arg}(tuned)" for arg in describe(tuned).split()]
    return (*row[:-1], f"{t.shape_class}:x{t.gain:.2f}", " ".join(engine) or "-")


def _tuned_dict(t: TunedSettings | None) -> dict | None:
    return None if t is None else {k: getattr(t, k) for k in TunedSettings.__dataclass_fields__}


# the synthetic samples of `freight models tune --shape`: bench/workloads.py's generators (the
# source tree's, not in the image) and each one's lines at scale 1
SHAPES = {
    "unique": ("unique_lines", 2000),
    "shared_prefix": ("shared_prefix_lines", 2000),
    "system_prompts": ("system_prompt_lines", 2000),
    "few_shot": ("multi_job_shared_prefix_lines", 1200),
    "blend": ("blend_lines", 600),
    "extract": ("extract_lines", 400),
}


def _shape_sample(name: str, checkpoint: str, requests: int) -> list[dict]:
    """``requests`` lines of a named synthetic shape, its texts measured with the model's tokenizer."""
    try:
        from bench import workloads
    except ImportError:
        raise click.ClickException(
            "--shape needs Freight's source tree (bench/workloads.py); give --sample FILE instead"
        ) from None
    function, nominal = SHAPES[name]
    make = getattr(workloads, function)
    return list(make(workloads.load_tokenizer(checkpoint), scale=requests / nominal))[:requests]


def _ints(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: give whole numbers, comma-separated") from None
    if any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: every value must be at least 1")
    return values


@models.command("tune")
@click.argument("name")
@click.option("--sample", "sample", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="an OpenAI batch JSONL of the work to tune for (its lines sampled evenly)")  # fmt: skip
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default=None,
              help="a synthetic sample of this shape instead (bench/workloads.py)")  # fmt: skip
@click.option("--requests", type=click.IntRange(1, 5000), default=256, show_default=True,
              help="lines in the sample")  # fmt: skip
@click.option("--max-num-seqs", "seqs", default=None, metavar="N,N", help="the max_num_seqs values to try")
@click.option("--max-num-batched-tokens", "tokens", default=None, metavar="N,N",
              help="the max_num_batched_tokens values to try")  # fmt: skip
@click.option("--speculative/--no-speculative", default=True, show_default=True,
              help="try n-gram (prompt-lookup) speculative decoding on the best point")  # fmt: skip
@click.option("--budget", type=click.FloatRange(0), default=600.0, show_default=True,
              help="seconds after which no further engine is started")  # fmt: skip
def models_tune(
    name: str, sample: Path | None, shape: str | None, requests: int, seqs: str | None, tokens: str | None,
    speculative: bool, budget: float,
) -> None:  # fmt: skip
    """Measure NAME's engine settings on a sample of work and store the best for its shape class;
    NAME's workers apply them at their next start (its explicit engine args still win)."""
    from storage.checkpoint_cache import local_checkpoint
    from storage.objectstore import s3_client
    from storage.registry import require
    from workers.model_tuning import TuneOptions, TuningError, read_sample, tune

    if (sample is None) == (shape is None):
        raise click.UsageError("give one of --sample FILE or --shape NAME")
    # the pilot's own lines tell what it measures; vLLM's start-up lines (a screenful per engine)
    # only where the operator asks for them
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    options = TuneOptions(sample=str(sample) if sample else f"shape:{shape}", seqs=_ints(seqs),
                          tokens=_ints(tokens), speculative=speculative, budget_seconds=budget)  # fmt: skip
    settings = command_settings()[0]
    with command_runtime(settings) as rt:
        entry = require(rt.db, settings, name)
        if entry.task != "generate":
            raise click.ClickException(
                f"{name} is a {entry.task} model: the pilot measures text generation only"
            )
        local = str(local_checkpoint(entry.checkpoint, Path(settings.model_cache_dir),
                                     lambda: s3_client(settings.s3_endpoint_url or None)))  # fmt: skip
        try:
            if sample is not None:
                lines, skipped = read_sample(sample, requests)
                for note in skipped:
                    _echo(f"skipped {note}")
            else:
                lines = _shape_sample(str(shape), local, requests)
            tuned = tune(rt, entry, local, lines, options, echo=_echo)
        except TuningError as exc:
            raise click.ClickException(str(exc)) from None
    _echo_tuning(tuned)
    click.echo(
        f"stored for {entry.name}, shape class {tuned.shape_class}: its workers apply it at their next start"
    )


def _echo_tuning(t: TunedSettings) -> None:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t.measured_at))
    if t.engine_args:
        verdict = (f"{describe(t.engine_args)}: {t.tokens_per_second:g} tok/s against {t.baseline_tokens_per_second:g} "
                   f"at the previous defaults ({describe(t.baseline_args)}), x{t.gain:.2f}")  # fmt: skip
    else:
        verdict = f"the previous defaults stand ({describe(t.baseline_args)}): {t.baseline_tokens_per_second:g} tok/s"
    click.echo(f"{t.model} / {t.shape_class}: {verdict}; {t.device}, sample {t.sample}, measured {when}")
    for p in t.points:
        figures = p.get("error") or f"{p['tokens_per_second']:g} tok/s, {p['seconds']:g} s"
        click.echo(f"  {p['label']}: {figures}")
    for note in t.notes:
        click.echo(f"  note: {note}")


@models.command("show")
@click.argument("name")
def models_show(name: str) -> None:
    """NAME's registry entry and its tuned engine settings, each shape class with its measurements
    (the first listed is the one its workers apply)."""
    from storage.registry import require, tunings

    settings = command_settings()[0]
    with command_runtime(settings) as rt:
        entry = require(rt.db, settings, name)
        tuned = [t for t in tunings(rt.db, name) if t.checkpoint == entry.checkpoint]
    for key, value in _as_dict(entry).items():
        click.echo(f"{key}: {json.dumps(value)}")
    if not tuned:
        click.echo("tuned: none (`freight models tune` measures them)")
    for i, t in enumerate(tuned):
        click.echo(f"tuned{' (applied)' if i == 0 else ''}:")
        _echo_tuning(t)


@models.command("remove")
@click.argument("name")
def models_remove(name: str) -> None:
    """Unregister NAME (refused while it has open batches). Its files are left alone."""
    from api.services.models import remove

    with command_runtime(command_settings()[0]) as rt:
        entry = remove(rt, name)
    click.echo(f"removed {entry.name} (checkpoint {entry.checkpoint} left in place)")


@models.command("add-adapter")
@click.argument("base")
@click.argument("name")
@click.option(
    "--path", required=True, help="the adapter's directory (adapter_config.json, adapter_model.safetensors)"
)
@click.option("--tenants", default="", metavar="T1,T2",
              help="only these tenants may use it (by name); default: every tenant")  # fmt: skip
def models_add_adapter(base: str, name: str, path: str, tenants: str) -> None:
    """Register NAME, a LoRA adapter of BASE, served as the model id NAME by BASE's workers."""
    from workers.adapter_registration import add_adapter

    with command_runtime(command_settings()[0]) as rt:
        first = not adapters(rt.db, base)
        entry = add_adapter(rt, base, name, path, tenants.split(",") if tenants else ())
    who = "every tenant" if entry.tenants is None else f"tenants {tenants}"
    click.echo(f"registered adapter {entry.name} of {entry.base} (rank {entry.rank}, for {who})")
    if first:
        click.echo(
            f"{base}'s first adapter: {base}'s running workers restart their engines with LoRA on "
            "before their next pack (no restart by hand)"
        )


@models.command("remove-adapter")
@click.argument("name")
def models_remove_adapter(name: str) -> None:
    """Unregister the adapter NAME (refused while its base has open batches). Its files are left alone."""
    from workers.adapter_registration import remove_adapter

    with command_runtime(command_settings()[0]) as rt:
        entry = remove_adapter(rt, name)
    click.echo(f"removed adapter {entry.name} of {entry.base} ({entry.path} left in place)")


@models.command("quantize")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("destination", type=click.Path(path_type=Path))
@click.option("--scheme", type=click.Choice(SCHEMES), default="w4a16", show_default=True)
@click.option("--group-size", type=int, default=128, show_default=True)
@click.option("--method", type=click.Choice(METHODS), default="auto", show_default=True,
              help="auto: GPTQ with --calibration, round-to-nearest without")  # fmt: skip
@click.option("--calibration", type=click.Path(path_type=Path), default=None,
              help="your own batch JSONL; its prompts calibrate GPTQ/AWQ")  # fmt: skip
@click.option("--register", "register", default=None, help="then register the result under this name")
def models_quantize(
    source: Path,
    destination: Path,
    scheme: str,
    group_size: int,
    method: str,
    calibration: Path | None,
    register: str | None,
) -> None:
    """Write an INT4 (W4A16, compressed-tensors) checkpoint of SOURCE to DESTINATION."""
    from workers.registration import AddRequest, add, quantize_checkpoint

    bar = _Bar("quantizing")
    try:
        with command_runtime(command_settings()[0]) as rt:
            out = quantize_checkpoint(
                rt,
                source,
                destination,
                group_size=group_size,
                method=method,
                calibration=calibration,
                progress=bar,
                echo=_echo,
            )
            bar.close()
            click.echo(f"wrote {scheme} checkpoint {out}")
            if register:
                entry = add(
                    rt, AddRequest(name=register, source=str(out.absolute()), quantization="none"), echo=_echo
                )
                click.echo(f"registered {entry.name}: {entry.quantization} from {entry.checkpoint}")
    finally:
        bar.close()
