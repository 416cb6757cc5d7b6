"""Facts about a checkpoint directory that metering needs, read from its files, not from vLLM.

Parameter count and bytes per parameter come from the safetensors headers (no tensor is loaded):
INT4 checkpoints pack 8 weights into each int32 of a ``*weight_packed`` tensor, so the bytes per
parameter of a W4A16 model come out near 0.5 plus its scales. KV bytes per token come from
config.json: keys and values, per layer, per KV head, at the model's dtype.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler.utilization import ModelShape
from storage.checkpoint_cache import local_checkpoint
from storage.checkpoint_config import merged, read_config
from storage.objectstore import s3_client
from storage.registry import ModelEntry, RegistryError, require

if TYPE_CHECKING:
    from storage.runtime import Runtime

log = logging.getLogger(__name__)


def checkpoint_dir(rt: Runtime, model: str, entry: ModelEntry | None = None) -> str:
    """The local checkpoint directory of a served model: KeyError if it is not served,
    CheckpointError if its files cannot be found or fetched. ``entry``: the model's registry entry
    as the caller read it already (a ``storage.registry.Catalog``'s), so it is not read again.

    The one place a model name becomes files on disk for the control side (validation loads the
    tokenizer from here): the registry entry's checkpoint, downloaded first if it is in S3."""
    if entry is None:
        try:
            entry = require(rt.db, rt.settings, model)
        except RegistryError as exc:
            raise KeyError(str(exc)) from exc
    cache = Path(rt.settings.model_cache_dir)
    return str(
        local_checkpoint(entry.checkpoint, cache, lambda: s3_client(rt.settings.s3_endpoint_url or None))
    )


DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
TORCH_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
PACKED_SUFFIX = "weight_packed"  # compressed-tensors pack-quantized: 8 int4 weights per int32
MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_header(path: Path) -> dict:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path.name}: safetensors header of {length} bytes")
        return json.loads(f.read(length))


def weights(model_dir: Path) -> tuple[int, int]:
    """(parameters, bytes) over every safetensors file of the checkpoint."""
    parameters = size = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, info in read_header(file).items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            width = DTYPE_BYTES.get(info["dtype"], 2)
            size += numel * width
            parameters += numel * (8 if name.endswith(PACKED_SUFFIX) and width == 4 else 1)
    return parameters, size


def kv_bytes_per_token(config: dict) -> int:
    text = merged(config)  # multimodal configs nest the language model
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    return 2 * layers * kv_heads * head_dim * TORCH_DTYPE_BYTES.get(_dtype_of(config) or "bfloat16", 2)


def stored_dtype(model_dir: str | Path) -> tuple[str | None, bool]:
    """(config.json's dtype, whether the checkpoint is quantized); (None, False) if unreadable."""
    try:
        config = read_config(model_dir)
    except (OSError, ValueError):
        return None, False
    return _dtype_of(config), _quantized(config)


def _dtype_of(config: dict) -> str | None:
    """The language model's dtype (``merged``: a multimodal config's text model's, else its own)."""
    text = merged(config)
    dtype = text.get("torch_dtype") or text.get("dtype")
    return str(dtype) if dtype else None


def _quantized(config: dict) -> bool:
    return bool(merged(config).get("quantization_config"))


def model_shape(model_dir: str | Path, served_dtype: str | None = None) -> ModelShape | None:
    """The checkpoint's shape for MFU/MBU and per-unit records; None (logged) if unreadable.

    ``served_dtype`` (an unquantized checkpoint served in another dtype than it is stored in,
    see ``workers.engine.serving_dtype``): weights and KV entries are counted at that width."""
    directory = Path(model_dir)
    try:
        parameters, size = weights(directory)
        config = read_config(directory)
        if parameters <= 0:
            raise ValueError("no safetensors weights")
        width = TORCH_DTYPE_BYTES.get(served_dtype or "")
        if width is not None and not _quantized(config):
            config["torch_dtype"] = served_dtype
            size = parameters * width  # the engine converts every weight to this dtype
        return ModelShape(
            parameters=parameters,
            bytes_per_parameter=size / parameters,
            kv_bytes_per_token=kv_bytes_per_token(config),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("model shape of %s unknown (%s): MFU and MBU will not be estimated", directory, exc)
        return None
