"""``freight models tune``: a short pilot of a model's engine settings on a sample of real work,
the best kept in the registry per shape class (storage/registry.py: TunedSettings).

Why measure rather than compute: what ``max_num_seqs`` and ``max_num_batched_tokens`` are worth
depends on the model, the device and the work together (scheduler/engine_tuning.py decides what
to try and what to keep). Each grid point is one engine start (tens of seconds here), so the
sample is small, each engine runs it once after a short salted warm-up (its prefix cache does not
help the measured run), and a time budget stops the grid early, saying which points it left.

The previous defaults are what a worker of the model starts with untuned (the FREIGHT_ENGINE_*
defaults under the model's explicit engine args): the first point, always measured. The winner
then runs once more with n-gram (prompt-lookup) speculative decoding where vLLM accepts it, kept
only if faster. Every point's engine is built as the worker builds it (workers/bootstrap.py:
engine_config), so what is measured is what a worker applies.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scheduler.engine_tuning import (
    CPU,
    GPU,
    Baseline,
    GridPoint,
    Measurement,
    MemoryFacts,
    SampleShape,
    choose,
    fitting,
    grid,
    shape_class,
    speculative_point,
)
from storage.registry import ModelEntry, TunedSettings, record_tuning
from storage.runtime import Runtime
from storage.settings import Settings
from workers.tuned_settings import host_memory_available, memory_facts, weight_bytes

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINE_BYTES = 1 << 20  # a sample line longer than this is skipped (the pilot reads in bounded memory)
WARMUP_LINES = 4  # unmeasured requests, salted apart from the measured run, per engine
WARMUP_SALT = "freight-tune-warmup"


class TuningError(RuntimeError):
    """The pilot cannot run or compare anything; the message is one line for the operator."""


@dataclass(frozen=True)
class TuneOptions:
    sample: str  # what the lines are, for the record: a file name or "shape:NAME"
    seqs: Sequence[int] | None = None  # the max_num_seqs axis (None: scheduler/engine_tuning.grid's)
    tokens: Sequence[int] | None = None  # the max_num_batched_tokens axis
    speculative: bool = True  # try n-gram speculation on the winner
    budget_seconds: float = 600.0  # no new engine start after this much of the pilot


def read_sample(path: Path, limit: int, seed: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
    """Up to ``limit`` generation lines of an OpenAI batch file, drawn evenly over the whole file
    (a reservoir, seeded), and a note per line skipped (its number and why). Memory is bounded by
    ``limit`` lines of at most MAX_LINE_BYTES each."""
    rng = random.Random(seed)
    kept: list[dict[str, Any]] = []
    notes: list[str] = []
    seen = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(_lines(f), 1):
            line, reason = _sample_line(raw)
            if line is None:
                if reason and len(notes) < 20:
                    notes.append(f"line {number}: {reason}")
                continue
            seen += 1
            if len(kept) < limit:
                kept.append(line)
            elif (j := rng.randrange(seen)) < limit:
                kept[j] = line
    if not kept:
        raise TuningError(f"{path}: no /v1/chat/completions or /v1/completions line to sample")
    return kept, notes


def _lines(f: Any) -> Iterator[bytes | None]:
    """Each line of ``f``; None for one over MAX_LINE_BYTES (read past, never held whole)."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield raw


def _sample_line(raw: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
    if raw is None:
        return None, f"longer than {MAX_LINE_BYTES} bytes"
    if not raw.strip():
        return None, None
    try:
        line = json.loads(raw)
    except ValueError as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(line, dict) or not isinstance(line.get("body"), dict):
        return None, "not a batch line with a body object"
    if line.get("url") not in ENDPOINTS:
        return None, f"url {line.get('url')!r} is not one of {', '.join(ENDPOINTS)}"
    return line, None


def _prompt_key(line: dict[str, Any]) -> str:
    body = line["body"]
    return json.dumps(body.get("messages", body.get("prompt")), sort_keys=True)


def engine_requests(lines: Sequence[dict[str, Any]], served_name: str, salt: str | None = None) -> list[Any]:
    """The lines as engine requests in prompt order (Freight's planner sorts a batch by prompt
    prefix; the text of the messages sorts alike for one chat template), the body's model
    replaced by the served name."""
    from workers.engine import EngineRequest

    ordered = sorted(lines, key=_prompt_key)
    return [
        EngineRequest(
            key=f"{salt or 'tune'}-{i}",
            endpoint=line["url"],
            body={**line["body"], "model": served_name},
            cache_salt=salt,
        )
        for i, line in enumerate(ordered)
    ]


def measure(engine: Any, point: GridPoint, lines: Sequence[dict[str, Any]]) -> Measurement:
    """One timed run of the sample on ``engine`` after an unmeasured, salted warm-up."""
    name = engine.config.served_name
    warm = engine_requests(lines[:WARMUP_LINES], name, WARMUP_SALT)
    for result in engine.run(warm):
        if not result.ok:
            return Measurement(point, error=f"warm-up request failed: {result.error}")
    requests = engine_requests(lines, name)
    started = time.monotonic()
    results = list(engine.run(requests))
    seconds = time.monotonic() - started
    failed = [r for r in results if not r.ok]
    if failed:
        return Measurement(point, error=f"{len(failed)} of {len(results)} requests failed: {failed[0].error}")
    return Measurement(
        point,
        seconds=seconds,
        output_tokens=sum(r.completion_tokens for r in results),
        prompt_tokens=sum(r.prompt_tokens for r in results),
        cached_tokens=sum(r.cached_tokens for r in results),
    )


@dataclass
class Pilot:
    """One pilot's state: the model, what each point measured, and what was left out."""

    settings: Settings
    entry: ModelEntry
    path: str  # the local checkpoint
    lines: Sequence[dict[str, Any]]
    echo: Callable[[str], None]
    measurements: list[Measurement]
    notes: list[str]
    started: float

    def config(self, point_args: dict[str, Any]) -> Any:
        """The engine a worker would start with these tuned args: the model's explicit ones win."""
        return _config(self.settings, self.entry, self.path, point_args)

    def run(self, point: GridPoint, args: dict[str, Any]) -> tuple[Measurement, tuple[int, int] | None]:
        """Start one engine for ``point`` in a fresh process, measure the sample on it, stop it;
        returns the measurement and the engine's (max_num_seqs, max_num_batched_tokens) (None when
        it did not start). A process per point: engines started one after another in one process
        did not run alike (the test's sample ran 12 times slower on the third engine than on the
        first of the same settings, 31.7 against 388.6 tok/s; vLLM-CPU binds its threads once a
        process and warns that it cannot set them again, a likely cause)."""
        import multiprocessing

        self.echo(f"measuring {point.label} ...")
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_run_point, args=(send, self.settings, self.entry, self.path,
                                                         list(self.lines), point, args))  # fmt: skip
        child.start()
        send.close()
        try:
            m, sizes = receive.recv()
        except EOFError:
            m, sizes = Measurement(point, error=f"the pilot's engine process ended ({child.exitcode})"), None
        finally:
            child.join()
        self.echo(f"  {m.error}" if m.error else f"  {m.tokens_per_second:.1f} tok/s ({m.seconds:.2f} s)")
        return m, sizes

    def over_budget(self, budget: float) -> bool:
        return time.monotonic() - self.started > budget


def _config(settings: Settings, entry: ModelEntry, path: str, point_args: dict[str, Any]) -> Any:
    from workers.bootstrap import engine_config

    args = {**point_args, **entry.engine_args}
    return engine_config(settings, entry.name, path, entry.max_model_len, args, entry.tool_call_parser,
                         task=entry.task)  # fmt: skip


def _run_point(
    send: Any,
    settings: Settings,
    entry: ModelEntry,
    path: str,
    lines: list[dict[str, Any]],
    point: GridPoint,
    args: dict[str, Any],
) -> None:
    """A pilot point's own process: start its engine, measure, send (measurement, sizes) back."""
    from workers.engine import Engine, EngineStartFailed, EngineUnsupported

    try:
        engine = Engine.start(_config(settings, entry, path, args))
    except (EngineStartFailed, EngineUnsupported) as exc:
        send.send((Measurement(point, error=f"vLLM did not start: {str(exc).splitlines()[0][:300]}"), None))
        return
    try:
        scheduler = engine.vllm_config.scheduler_config
        sizes = (int(scheduler.max_num_seqs), int(scheduler.max_num_batched_tokens))
        send.send((measure(engine, point, lines), sizes))
    except Exception as exc:  # the parent records it as this point's error
        send.send((Measurement(point, error=f"{type(exc).__name__}: {str(exc)[:300]}"), None))
    finally:
        engine.shutdown()
        send.close()


def device_of() -> str:
    """gpu where torch sees CUDA, else cpu (vLLM-CPU)."""
    try:
        import torch

        return GPU if torch.cuda.is_available() else CPU
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return CPU


def tune(
    rt: Runtime,
    entry: ModelEntry,
    path: str,
    lines: Sequence[dict[str, Any]],
    options: TuneOptions,
    echo: Callable[[str], None] = log.info,
) -> TunedSettings:
    """Run the pilot for ``entry`` (its checkpoint at the local ``path``) on ``lines`` and store
    the best settings for the sample's shape class; returns what was stored."""
    settings = rt.settings
    device = device_of()
    pilot = Pilot(settings, entry, path, lines, echo, [], [], time.monotonic())
    defaults = GridPoint()
    first, sizes = pilot.run(defaults, {})
    if sizes is None:
        raise TuningError(f"model {entry.name!r}: the previous defaults did not start: {first.error}")
    base = Baseline(sizes[0], sizes[1], frozenset(entry.engine_args))
    first = replace(first, point=GridPoint(base.max_num_seqs, base.max_num_batched_tokens))
    if first.error is not None:
        raise TuningError(f"model {entry.name!r}: the previous defaults failed the sample: {first.error}")
    pilot.measurements.append(first)
    points, notes = grid(base, device, options.seqs, options.tokens, sample_lines=len(lines))
    pilot.notes.extend(notes)
    facts = memory_facts(path, weight_bytes(path), pilot.config({}).kv_cache_bytes or 0,
                         int(entry.max_model_len or settings.engine_max_model_len or 2048),
                         host_memory_available())  # fmt: skip
    points, unfit = fitting(points[1:], facts)
    pilot.notes.extend(unfit)
    for point in points:
        if pilot.over_budget(options.budget_seconds):
            pilot.notes.append(
                f"{point.label}: not measured, the {options.budget_seconds:g} s budget was spent"
            )
            continue
        pilot.measurements.append(pilot.run(point, point.engine_args())[0])
    if len(pilot.measurements) > 1:
        _defaults_again(pilot)
    _try_speculation(pilot, options, facts)
    choice = choose(pilot.measurements)
    shape = SampleShape(len(lines), first.prompt_tokens, first.cached_tokens, first.output_tokens)
    tuned = TunedSettings(
        model=entry.name,
        shape_class=shape_class(shape),
        checkpoint=entry.checkpoint,
        engine_args=choice.engine_args,
        tokens_per_second=round(choice.best.tokens_per_second, 2),
        baseline_tokens_per_second=round(choice.baseline.tokens_per_second, 2),
        baseline_args=first.point.engine_args(),
        sample=f"{options.sample} ({len(lines)} lines)"[:300],
        device=device,
        points=[m.as_dict() for m in pilot.measurements],
        notes=[*pilot.notes, *choice.notes],
        measured_at=int(time.time()),
    )
    record_tuning(rt.db, tuned)
    return tuned


def _defaults_again(pilot: Pilot) -> None:
    """The previous defaults once more, after the grid, the faster of their two runs kept as the
    baseline: a shared machine's load moves during a pilot, and a point should not win only by
    running at a quieter moment than the defaults did (conservative: the defaults get the better
    of two chances). Run past the budget: the comparison needs it."""
    first = pilot.measurements[0]
    again = pilot.run(first.point, {})[0]
    if again.error is None and again.tokens_per_second > first.tokens_per_second:
        pilot.measurements[0] = again
    pilot.notes.append(
        f"the previous defaults ran first and again after the grid: {first.tokens_per_second:.1f} and "
        f"{again.tokens_per_second:.1f} tok/s{'' if again.error is None else f' ({again.error})'}; the faster is the baseline"
    )


def _try_speculation(pilot: Pilot, options: TuneOptions, facts: MemoryFacts) -> None:
    """The best plain point once more with n-gram speculation, where vLLM accepts it here."""
    if not options.speculative:
        pilot.notes.append("n-gram speculation: not tried (--no-speculative)")
        return
    if "speculative_config" in pilot.entry.engine_args:
        pilot.notes.append("n-gram speculation: the model sets speculative_config itself: not tried")
        return
    if pilot.over_budget(options.budget_seconds):
        pilot.notes.append(
            f"n-gram speculation: not tried, the {options.budget_seconds:g} s budget was spent"
        )
        return
    ran = [m for m in pilot.measurements if m.error is None]
    point = speculative_point(max(ran, key=lambda m: m.tokens_per_second).point)
    _, unfit = fitting([point], facts)
    if unfit:
        pilot.notes.extend(unfit)
        return
    measured = pilot.run(point, point.engine_args())[0]
    if measured.error is not None:
        pilot.notes.append(f"n-gram speculation: vLLM refused it on this host: {measured.error}")
    pilot.measurements.append(measured)
