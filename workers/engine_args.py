"""A model's own vLLM engine arguments: ``KEY=VALUE`` texts checked and parsed at registration,
then laid over the FREIGHT_ENGINE_* defaults when a worker builds its engine.

Why vLLM's own parser: an operator who knows ``vllm serve --kv-cache-dtype fp8`` writes
``--engine-arg kv_cache_dtype=fp8`` and means the same thing. Each value goes through the type and
choices vLLM's command line gives that field (ints, floats, ``8k``-style sizes, booleans, JSON for
dict-valued fields like ``speculative_config``), so a value vLLM would refuse is refused when the
model is registered, with vLLM's reason and the field's name, not when a worker on another machine
starts. What a machine cannot honour (two GPUs on a one-GPU host) only its worker can find out:
that is refused at the worker's start (workers/bootstrap.py).

A few fields are Freight's own (``OWNED``): setting them would break something Freight relies on,
so they are refused with the reason. vLLM is imported inside the functions: the registry and the
``freight`` commands that never parse engine arguments must not pay for it.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

# fields Freight sets itself, and why an operator may not
OWNED: dict[str, str] = {
    "model": "the checkpoint is the model's --path (or Freight's INT4 copy of it)",
    "served_model_name": "the served name is the registered NAME",
    "tokenizer": "validation tokenizes prompts with the checkpoint's own tokenizer and the engine runs "
    "those token ids; another tokenizer would disagree with them",
    "skip_tokenizer_init": "Freight renders chat templates and counts tokens with the engine's tokenizer",
    "enable_prefix_caching": "Freight packs requests in prompt-prefix order and isolates tenants' "
    "cache entries (FREIGHT_PREFIX_CACHE_SHARING); both need vLLM's prefix cache on",
    "seed": "the engine seed stays 0 so a redelivered unit samples as its first attempt did; a "
    "request's own `seed` field sets its sampling",
    "disable_log_stats": "Freight counts engine steps itself: vLLM's stat loggers cost throughput, so they "
    "run exactly where FREIGHT_ENGINE_METRICS_BIND serves their metrics",
    "data_parallel_size": "an engine worker runs one engine replica: start more workers of the model "
    "(`freight worker --model NAME`, one per GPU set) for data parallelism",
}
# allowed only on a model registered with `--quantization none`: vLLM then quantizes the weights at
# load (fp8, say); Freight's own --quantization chooses and records an INT4 checkpoint otherwise
QUANTIZATION = "quantization"
QUANTIZATION_REASON = (
    "engine arg quantization is vLLM's quantization at load of an unquantized checkpoint: register the "
    "model with --quantization none to use it (Freight's --quantization picks INT4 checkpoints itself)"
)
# a model's own max_model_len is the registry's max_model_len column (--max-model-len): one place,
# also what /v1/models shows
MAX_MODEL_LEN = "max_model_len"

# fields that override a FREIGHT_ENGINE_* default: EngineArgs field -> workers.engine.EngineConfig's
CONFIG_FIELDS: dict[str, str] = {
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "kv_cache_memory_bytes": "kv_cache_bytes",
    "block_size": "block_size",
    "enforce_eager": "enforce_eager",
    "dtype": "dtype",
}

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


class EngineArgError(ValueError):
    """An engine argument Freight refuses; the message is one line for the operator."""


@functools.lru_cache(maxsize=1)
def _cli_actions() -> dict[str, Any]:
    """vLLM's own command-line options of EngineArgs, by field name (what `vllm serve` parses)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False))
    return {a.dest: a for a in parser._actions if a.option_strings}


@functools.lru_cache(maxsize=1)
def _fields() -> frozenset[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def field_name(key: str) -> str:
    """The EngineArgs field ``key`` names (``--tensor-parallel-size`` and ``tensor_parallel_size``
    alike); refused when vLLM has no such field or Freight owns it."""
    name = key.strip().removeprefix("--").replace("-", "_")
    if name not in _fields():
        close = difflib.get_close_matches(name, sorted(_fields()), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise EngineArgError(
            f"unknown engine arg {key!r}: vLLM {_vllm_version()}'s EngineArgs has no such field{hint}"
        )
    if name in OWNED:
        raise EngineArgError(f"engine arg {name!r} is Freight's: {OWNED[name]}")
    if name not in _cli_actions():
        raise EngineArgError(f"engine arg {name!r} has no `vllm serve` option: Freight sets only those")
    return name


def _bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise EngineArgError(f"bad value for engine arg {name!r}: {text!r} is not true or false")


def _convert(name: str, action: Any, text: str) -> Any:
    import argparse

    try:
        value = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EngineArgError(f"bad value for engine arg {name!r}: {reason[:300]}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices if c is not None)
        raise EngineArgError(f"bad value for engine arg {name!r}: {text!r} is not one of {choices}")
    return value


def _stored(name: str, value: Any, text: str) -> Any:
    """``value`` as the JSON the registry keeps (and EngineArgs accepts back): a config object vLLM
    parsed from JSON is kept as that JSON."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        return sorted(items) if isinstance(value, set | frozenset) else items
    try:  # a dataclass of vLLM's (compilation_config, attention_config...) given as JSON
        loaded = json.loads(text)
    except ValueError:
        raise EngineArgError(f"give engine arg {name!r} as a JSON object") from None
    return loaded


def parse_value(name: str, text: str | None) -> Any:
    """One field's value from its text, as `vllm serve --NAME TEXT` would parse it (None: the flag
    given alone, which only booleans accept)."""
    import argparse

    action = _cli_actions()[name]
    if isinstance(action, argparse.BooleanOptionalAction):
        return True if text is None else _bool(name, text)
    if text is None:
        if action.nargs == "?" and action.const is not None:
            return action.const
        raise EngineArgError(f"engine arg {name!r} needs a value: {name}=VALUE")
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if text.strip().startswith("["):
            try:
                raw = json.loads(text)
            except ValueError as exc:
                raise EngineArgError(f"bad value for engine arg {name!r}: not a JSON list ({exc})") from None
            if not isinstance(raw, list):
                raise EngineArgError(f"bad value for engine arg {name!r}: not a JSON list")
            items = [x if isinstance(x, str) else json.dumps(x) for x in raw]
        else:
            items = [x for x in text.replace(",", " ").split() if x]
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise EngineArgError(f"engine arg {name!r} takes {action.nargs} values, not {len(items)}")
        if action.nargs == "+" and not items:
            raise EngineArgError(f"engine arg {name!r} needs at least one value")
        return [_stored(name, _convert(name, action, item), item) for item in items]
    return _stored(name, _convert(name, action, text), text)


def parse_assignments(texts: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` texts (``KEY`` alone: a boolean's true) as {field: value}; refused with a
    one-line reason naming the field. A field given twice is refused (which one was meant?)."""
    values: dict[str, Any] = {}
    for raw in texts:
        key, sep, text = raw.partition("=")
        if not key.strip():
            raise EngineArgError(f"engine arg {raw!r}: give KEY=VALUE, for example tensor_parallel_size=2")
        name = field_name(key)
        if name in values:
            raise EngineArgError(f"engine arg {name!r} is given twice")
        values[name] = parse_value(name, text if sep else None)
    return values


def check(values: Mapping[str, Any], model_path: str | None = None) -> None:
    """Refuse arguments vLLM's EngineArgs refuses together (its own checks at construction), before
    they are stored; the machine-dependent checks are the worker's."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = {k: v for k, v in values.items() if k != MAX_MODEL_LEN}
    if model_path:
        kwargs["model"] = model_path
    try:
        EngineArgs(**kwargs)
    except Exception as exc:  # vLLM raises what it likes here (ValueError, pydantic's, TypeError)
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EngineArgError(f"vLLM refuses engine args {describe(values)}: {cause[:300]}") from None


def describe(values: Mapping[str, Any]) -> str:
    """``k=v k2=v2`` in field order, values as JSON where they are not plain (for listings and
    messages)."""
    return " ".join(f"{k}={_text(v)}" for k, v in sorted(values.items()))


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    return json.dumps(value, separators=(",", ":"))
