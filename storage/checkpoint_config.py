"""A checkpoint's ``config.json``, read in one place for everyone who asks what a model is.

The registry (its quantization and task), the engine worker's metering (dtype, layers, heads), the
quantizer and the console's model list all read it. A multimodal checkpoint nests its language
model's keys (sizes, dtype, often its quantization) under ``text_config``, which a reader of the
outer keys alone misses; here they are merged over the outer ones, so every caller sees the
language model's figures. The outer model's ``architectures`` and ``quantization_config`` stay
where it has them: they describe the whole checkpoint (what it is for, how its files are packed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
OUTER_KEYS = ("architectures", "quantization_config")  # the whole checkpoint's, not the text model's


def read_config(directory: str | Path) -> dict[str, Any]:
    """The config of a local checkpoint directory, ``text_config`` merged (see the module's
    docstring). Raises OSError when there is no readable config.json, ValueError when it is not a
    JSON object."""
    config = json.loads((Path(directory) / CONFIG_FILE).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{directory}/{CONFIG_FILE} is not a JSON object")
    return merged(config)


def config_or_empty(location: str | Path) -> dict[str, Any]:
    """``read_config`` of a local checkpoint, or {} for one in S3 (not fetched to be described) or
    one whose config cannot be read: callers treat {} as "unknown"."""
    if str(location).startswith("s3://"):
        return {}
    try:
        return read_config(location)
    except (OSError, ValueError):
        return {}


def merged(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``text_config``'s keys over its own (but for the OUTER_KEYS it has) and
    ``text_config`` itself gone, so that merging a merged config changes nothing."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    out = {k: v for k, v in config.items() if k != "text_config"} | text
    out.update((k, config[k]) for k in OUTER_KEYS if k in config)
    return out
