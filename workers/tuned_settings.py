"""Which tuned engine settings a worker applies on its host (``freight models tune``), and the
memory facts both the pilot (workers/model_tuning.py) and the worker's start check them with.

Why a check at start as well as in the pilot: a tuning is measured on one machine and applied by
every worker of the model, and a worker's host may be smaller than the pilot's. The arithmetic is
scheduler/engine_tuning.py's; this module reads the host (``/proc/meminfo``) and the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from scheduler.engine_tuning import GridPoint, MemoryFacts, unfit
from storage.checkpoint_config import config_or_empty
from storage.db import Database
from storage.registry import ModelEntry, applied_tuning
from storage.settings import Settings

log = logging.getLogger(__name__)


def host_memory_available() -> int:
    """This host's available memory in bytes (MemAvailable of /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable: the host's memory cannot be checked")


def memory_facts(
    path: str, weight_bytes: int, kv_cache_bytes: int, max_model_len: int, available: int
) -> MemoryFacts:
    """A model's sizes from its checkpoint's config.json (Llama-style field names)."""
    config = config_or_empty(path)
    hidden = int(config.get("hidden_size") or 0)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    layers = int(config.get("num_hidden_layers") or 0)
    element = 2 if str(config.get("torch_dtype", "bfloat16")) in ("bfloat16", "float16") else 4
    return MemoryFacts(
        available_bytes=available,
        weight_bytes=weight_bytes,
        kv_cache_bytes=kv_cache_bytes,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * element,
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
        vocab_size=int(config.get("vocab_size") or 0),
        max_model_len=max_model_len,
    )


def weight_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors")) or sum(
        p.stat().st_size for p in Path(path).glob("*.bin")
    )


def engine_args_on_this_host(
    settings: Settings, db: Database, entry: ModelEntry, path: str
) -> dict[str, Any]:
    """The engine args a worker of ``entry`` starts with: its explicit ones over its applied
    tuning's (storage/registry.py: applied_engine_args), the tuning left out, with a warning, when
    this host's memory cannot hold it (a tuning measured on a larger machine)."""
    tuned = applied_tuning(db, entry)
    if tuned is None or not tuned.engine_args:
        return dict(entry.engine_args)
    args = {**tuned.engine_args, **entry.engine_args}
    point = GridPoint(
        args.get("max_num_seqs", settings.engine_max_num_seqs or None),
        args.get("max_num_batched_tokens", settings.engine_max_num_batched_tokens or None),
        "speculative_config" in tuned.engine_args and "speculative_config" not in entry.engine_args,
    )
    kv_cache_bytes = int(args.get("kv_cache_memory_bytes") or settings.engine_kv_cache_gib * 1024**3)
    max_model_len = int(entry.max_model_len or settings.engine_max_model_len or 2048)
    facts = memory_facts(path, weight_bytes(path), kv_cache_bytes, max_model_len, host_memory_available())
    reason = unfit(point, facts)
    if reason is not None:
        log.warning(
            "tuned engine args of %s (%s) not applied on this host: %s", entry.name, tuned.shape_class, reason
        )
        return dict(entry.engine_args)
    return args
