"""The model registry's writes that need checkpoints: add a model (quantized, probed) and set its
vLLM engine arguments; quantize a checkpoint.

``add`` is where a quantization choice becomes a served checkpoint: a checkpoint that is already
quantized is served as it is; ``w4a16`` quantizes a full-precision one (round-to-nearest) into
Freight's quantized folder; ``auto`` does the same and then keeps INT4 only if a measured probe on
this machine says it is faster than BF16 (the probe's figures stay in the row).

``add`` and ``set_engine`` also take the model's own vLLM engine arguments, checked and parsed
(workers/engine_args.py) before anything is written or quantized, so a bad one is refused here and
not at a worker's start.

Why here and not with the API's services: registering reads checkpoints, launches quantization
and runs the probe's engines, work of the worker side (``freight models`` calls it, and a task
could); an API process only reads the registry (``api.services.models``).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from storage.checkpoint_cache import CheckpointError, local_checkpoint, publish
from storage.errors import ServiceError
from storage.models import Adapter, Model
from storage.objectstore import s3_client
from storage.registry import (
    EMBED,
    GENERATE,
    REQUESTED,
    SCORE,
    TASKS,
    TRANSCRIBE,
    ModelEntry,
    local_quantization,
    local_task,
    lookup,
)
from storage.runtime import Runtime
from workers.checkpoint import weights
from workers.engine_args import (
    MAX_MODEL_LEN,
    QUANTIZATION,
    QUANTIZATION_REASON,
    EngineArgError,
    check,
    field_name,
    parse_assignments,
)
from workers.prefix_caching import caches_prefixes
from workers.probe import ProbeError, choose, run_probe
from workers.quantize import QuantizeError, QuantizeRequest, quantizable, quantize, read_config
from workers.quantize_env import ensure
from workers.tool_calls import check_parser_names

TOOL_CALL_PARSER = "tool_call_parser"  # `--unset tool_call_parser`: the registry's, not an engine arg
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
CALIBRATION_LIMIT = 512  # prompts read from a calibration file
Echo = Callable[[str], None]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class AddRequest:
    name: str
    source: str
    quantization: str = "auto"
    max_model_len: int | None = None
    instance_price_per_hour: float | None = None
    list_price_input: float | None = None
    list_price_cached: float | None = None
    list_price_output: float | None = None
    engine_args: tuple[str, ...] = ()  # KEY=VALUE texts, as `--engine-arg` gives them
    tool_call_parser: str | None = (
        None  # vLLM's name (`vllm serve --tool-call-parser`): serves tool_choice auto
    )
    task: str = "auto"  # generate|embed; auto: what the checkpoint's architecture says


def _check(req: AddRequest) -> None:
    if not NAME.match(req.name):
        raise ServiceError(
            "invalid_request", f"invalid model name {req.name!r}: letters, digits and ._:/- only"
        )
    if req.quantization not in REQUESTED:
        raise ServiceError(
            "invalid_request", f"unsupported quantization {req.quantization!r}: one of {', '.join(REQUESTED)}"
        )
    if req.task not in ("auto", *TASKS):
        raise ServiceError(
            "invalid_request", f"unsupported task {req.task!r}: one of auto, {', '.join(TASKS)}"
        )
    if req.max_model_len is not None and req.max_model_len < 1:
        raise ServiceError("invalid_request", "--max-model-len must be positive")
    prices = (req.instance_price_per_hour, req.list_price_input, req.list_price_cached, req.list_price_output)
    if any(p is not None and p < 0 for p in prices):
        raise ServiceError("invalid_request", "prices cannot be negative")
    if (req.list_price_input is None) != (req.list_price_output is None):
        raise ServiceError("invalid_request", "give both --list-price-in and --list-price-out, or neither")


def engine_args(texts: Sequence[str], *, quantization: str, model_path: str | None = None) -> dict[str, Any]:
    """``KEY=VALUE`` texts as the {field: value} the registry stores, or the refusal naming the field.

    ``quantization`` is the model's served one (``none``: an unquantized checkpoint, which vLLM may
    quantize at load); ``max_model_len`` stays in the result for the caller to move to its column."""
    if not texts:
        return {}
    try:
        values = parse_assignments(texts)
        if QUANTIZATION in values and quantization != "none":
            raise EngineArgError(QUANTIZATION_REASON)
        if MAX_MODEL_LEN in values and not (
            isinstance(values[MAX_MODEL_LEN], int) and values[MAX_MODEL_LEN] > 0
        ):
            raise EngineArgError(
                f"engine arg max_model_len must be a positive number of tokens, not {values[MAX_MODEL_LEN]!r}"
            )
        check(values, model_path)
    except EngineArgError as exc:
        raise ServiceError("invalid_request", str(exc), param="engine_args") from exc
    return values


def parsers_check(tool_call_parser: str | None, args: dict[str, Any]) -> None:
    """The tool-call parser and the reasoning_parser engine arg name parsers vLLM has registered."""
    reasoning = args.get("reasoning_parser")
    try:
        check_parser_names(tool_call_parser, reasoning if isinstance(reasoning, str) and reasoning else None)
    except ValueError as exc:
        param = "tool_call_parser" if str(exc).startswith("--tool-call-parser") else "engine_args"
        raise ServiceError("invalid_request", str(exc), param=param) from exc


def engine_args_check(values: dict[str, Any], model_path: str | None) -> None:
    try:
        check(values, model_path)
    except EngineArgError as exc:
        raise ServiceError("invalid_request", str(exc), param="engine_args") from exc


def add(rt: Runtime, req: AddRequest, *, echo: Echo = print, progress: Progress | None = None) -> ModelEntry:
    _check(req)
    if not req.source.startswith("s3://"):  # workers may start elsewhere in the tree
        req = replace(req, source=str(Path(req.source).absolute()))
    req, args = _requested_engine_args(req)
    if req.tool_call_parser is not None or args.get("reasoning_parser"):
        parsers_check(req.tool_call_parser, args)
    with rt.db.read() as s:
        if s.get(Model, req.name) is not None:
            raise ServiceError("conflict", f"model {req.name!r} is already registered: remove it first")
        if s.scalar(select(Adapter.id).where(Adapter.name == req.name)) is not None:
            raise ServiceError("conflict", f"{req.name!r} is the name of a LoRA adapter: remove it first")
    try:
        local = local_checkpoint(req.source, Path(rt.settings.model_cache_dir), _s3_factory(rt))
    except CheckpointError as exc:
        raise ServiceError("invalid_request", str(exc), param="path") from exc
    detected = local_quantization(str(local))
    task = local_task(str(local)) if req.task == "auto" else req.task
    if task in (EMBED, SCORE, TRANSCRIBE) and detected == "none":
        req = _served_as_is(req)
    checkpoint, served, served_dir, probe = _served_checkpoint(rt, req, local, detected, echo, progress)
    parameters, size = weights(served_dir)
    prefixes = caches_prefixes(str(served_dir), task, args)  # asked once here, not per validation
    row = Model(
        name=req.name,
        source=req.source,
        checkpoint=checkpoint,
        requested_quantization=req.quantization,
        quantization=served,
        max_model_len=req.max_model_len,
        instance_price_per_hour=req.instance_price_per_hour,
        list_price_input=req.list_price_input,
        list_price_cached=req.list_price_cached,
        list_price_output=req.list_price_output,
        parameters=parameters or None,
        weight_bytes=size or None,
        probe=probe,
        created_at=int(time.time()),
        engine_args=args or None,
        tool_call_parser=req.tool_call_parser,
        task=task,
        caches_prefixes=prefixes,
    )
    with rt.db.write() as s:
        s.add(row)
    entry = lookup(rt.db, rt.settings, req.name)
    assert entry is not None
    return entry


def _requested_engine_args(req: AddRequest) -> tuple[AddRequest, dict[str, Any]]:
    """The request's engine args, checked before anything is downloaded or quantized; an engine
    arg max_model_len moves to the request's own (and must agree with it)."""
    if not req.engine_args:
        return req, {}
    model_path = None if req.source.startswith("s3://") else req.source
    args = engine_args(req.engine_args, quantization=req.quantization, model_path=model_path)
    if MAX_MODEL_LEN in args:
        given = args.pop(MAX_MODEL_LEN)
        if req.max_model_len is not None and req.max_model_len != given:
            raise ServiceError(
                "invalid_request",
                f"--max-model-len {req.max_model_len} and engine arg max_model_len={given} disagree",
            )
        req = replace(req, max_model_len=given)
    return req, args


def _served_as_is(req: AddRequest) -> AddRequest:
    """An unquantized embedding model, cross-encoder or speech model is served as it is: Freight's
    INT4 copy and its probe measure text generation (a checkpoint already quantized elsewhere is served as that)."""
    if req.quantization == "w4a16":
        raise ServiceError(
            "invalid_request",
            "--quantization w4a16 is for text-generation models; serve an embedding model with "
            "--quantization none, or register a checkpoint already quantized",
        )
    return replace(req, quantization="none")


def _served_checkpoint(
    rt: Runtime, req: AddRequest, local: Path, detected: str, echo: Echo, progress: Progress | None
) -> tuple[str, str, Path, dict[str, Any] | None]:
    """What the model serves: (checkpoint location, quantization, local directory, probe): the
    checkpoint as it is, or an INT4 copy made here (published to the object store) when asked
    for, or chosen by the probe."""
    checkpoint, served, served_dir, probe = req.source, detected, local, None
    if req.quantization in ("awq", "gptq") and detected != req.quantization:
        raise ServiceError(
            "invalid_request",
            f"{req.source} is not a {req.quantization.upper()} checkpoint (it is {detected}); make one with "
            f"`freight models quantize SRC DST --calibration FILE.jsonl --method {req.quantization}`",
        )
    if req.quantization == "auto" and detected == "none" and not quantizable(read_config(local)):
        # a vision-language model, say: Freight's round-to-nearest INT4 covers text decoders only
        echo(f"not quantized: {req.source} is not an architecture Freight's INT4 covers; served as it is")
    elif req.quantization in ("w4a16", "auto") and detected == "none":
        int4_dir = Path(rt.settings.quantized_dir) / f"{_slug(req.name)}-w4a16-{int(time.time())}"
        echo(f"quantizing {req.source} to W4A16 (round-to-nearest) into {int4_dir}")
        _quantize(QuantizeRequest(source=local, destination=int4_dir), progress)
        served = "w4a16"
        if req.quantization == "auto":
            probe = _probe_int4(rt, local, int4_dir, echo)
            if probe["chosen"] == "none":
                shutil.rmtree(int4_dir, ignore_errors=True)
                served = "none"
        if served == "w4a16":  # workers on other machines load it from the object store
            checkpoint, served_dir = publish(int4_dir, rt.settings.object_store_url, rt.store), int4_dir
    elif req.quantization == "w4a16" and detected not in ("w4a16", "gptq", "awq"):
        raise ServiceError("invalid_request", f"{req.source} is quantized as {detected}, not INT4")
    return checkpoint, served, served_dir, probe


def _probe_int4(rt: Runtime, local: Path, int4_dir: Path, echo: Echo) -> dict[str, Any]:
    """BF16 against the INT4 copy on this machine, with the choice (``probe["chosen"]``) made;
    the copy is deleted if the probe fails."""
    echo("probing BF16 against INT4 on this machine (one engine each)")
    try:
        probe = run_probe(local, int4_dir, eager=rt.settings.engine_enforce_eager, now=time.time())
    except ProbeError as exc:
        shutil.rmtree(int4_dir, ignore_errors=True)
        raise ServiceError("invalid_request", str(exc)) from exc
    probe["chosen"] = choose(probe, rt.settings.int4_min_speedup)
    echo(f"probe: INT4/BF16 output tok/s {probe['int4_over_bf16']} -> serving {probe['chosen']}")
    return probe


def _s3_factory(rt: Runtime):
    return lambda: s3_client(rt.settings.s3_endpoint_url or None)


def set_engine(
    rt: Runtime,
    name: str,
    assign: Sequence[str] = (),
    unset: Sequence[str] = (),
    tool_call_parser: str | None = None,
) -> ModelEntry:
    """Set (``KEY=VALUE``) and unset (``KEY``) a registered model's engine arguments, and set
    (``tool_call_parser``) or unset (``--unset tool_call_parser``) its tool-call parser. Its
    workers apply them at their next start; batches of the model are untouched."""
    if not assign and not unset and tool_call_parser is None:
        raise ServiceError(
            "invalid_request", "give --engine-arg KEY=VALUE, --tool-call-parser NAME or --unset KEY"
        )
    with rt.db.write() as s:
        row = s.get(Model, name)
        if row is None:
            if name in rt.settings.models:
                raise ServiceError(
                    "conflict",
                    f"model {name!r} is declared by FREIGHT_MODELS, which has no engine args: register it "
                    f"with `freight models add {name} --path ... --engine-arg KEY=VALUE`",
                )
            raise ServiceError("not_found", f"model {name!r} is not registered", code="model_not_found")
        current = dict(row.engine_args or {})
        if row.max_model_len is not None:
            current[MAX_MODEL_LEN] = row.max_model_len
        parser = row.tool_call_parser if tool_call_parser is None else tool_call_parser
        if TOOL_CALL_PARSER in unset:
            if row.tool_call_parser is None:
                raise ServiceError("invalid_request", f"{name} has no tool-call parser to unset")
            parser = None
        for key in (k for k in unset if k != TOOL_CALL_PARSER):
            try:
                field = field_name(key)
            except EngineArgError as exc:
                raise ServiceError("invalid_request", str(exc), param="engine_args") from exc
            if field not in current:
                listed = ", ".join(sorted(current)) or "none"
                raise ServiceError(
                    "invalid_request", f"engine arg {field!r} is not set for {name} (set: {listed})"
                )
            del current[field]
        model_path = None if row.source.startswith("s3://") else row.source
        given = engine_args(assign, quantization=row.quantization, model_path=model_path)
        merged = {**current, **given}
        if given and current:  # the whole set must still be one vLLM accepts together
            engine_args_check(merged, model_path)
        if tool_call_parser is not None or given.get("reasoning_parser"):
            parsers_check(parser, merged)
        max_model_len = merged.pop(MAX_MODEL_LEN, None)
        row.max_model_len = max_model_len
        row.engine_args = merged or None
        row.tool_call_parser = parser
        # engine args can change whether the engine caches prefixes (a pooler's type): not known
        # until asked again below, outside this transaction (vLLM takes a second to answer); one in
        # S3 is not fetched for it, and validation asks vLLM itself while this is NULL
        row.caches_prefixes = None
        checkpoint, task = row.checkpoint, row.task or GENERATE
    if not checkpoint.startswith("s3://"):
        prefixes = caches_prefixes(checkpoint, task, merged)
        with rt.db.write() as s:
            s.execute(update(Model).where(Model.name == name).values(caches_prefixes=prefixes))
    entry = lookup(rt.db, rt.settings, name)
    assert entry is not None
    return entry


def quantize_checkpoint(
    rt: Runtime,
    source: Path,
    destination: Path,
    *,
    group_size: int = 128,
    method: str = "auto",
    calibration: Path | None = None,
    progress: Progress | None = None,
    echo: Echo = print,
) -> Path:
    prompts = tuple(read_calibration(calibration, source)) if calibration else ()
    request = QuantizeRequest(source, destination, "w4a16", group_size, method, prompts)
    env_python = None
    if request.resolved_method in ("gptq", "awq") and prompts:
        env_python = ensure(Path(rt.settings.quantize_env), echo=echo)
    return _quantize(request, progress, env_python)


def _quantize(request: QuantizeRequest, progress: Progress | None, env_python: Path | None = None) -> Path:
    try:
        return quantize(request, progress, env_python)
    except QuantizeError as exc:
        raise ServiceError("invalid_request", str(exc)) from exc


def read_calibration(path: Path, model_dir: Path) -> list[str]:
    """Prompts from the user's own batch JSONL (chat ``messages`` rendered with the model's chat
    template, or completion ``prompt``), at most CALIBRATION_LIMIT; bad lines are named."""
    if not path.is_file():
        raise ServiceError("invalid_request", f"{path}: no such calibration file")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts: list[str] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if len(prompts) >= CALIBRATION_LIMIT:
                break
            if not raw.strip():
                continue
            try:
                prompts.append(_prompt_text(json.loads(raw), tokenizer))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ServiceError(
                    "invalid_request", f"{path}: line {number}: not a batch request ({exc})"
                ) from exc
    if not prompts:
        raise ServiceError("invalid_request", f"{path}: no calibration prompts")
    return prompts


def _prompt_text(line: dict[str, Any], tokenizer: Any) -> str:
    body = line.get("body", line)
    if "messages" in body:
        return str(
            tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        )
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise TypeError("prompt must be a string")
    return prompt


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)
