"""Whether vLLM caches prompt prefixes for a model, as the cache-hit predictions need to know.

vLLM decides it when the engine starts, from the model's config
(``ModelConfig.is_prefix_caching_supported``): a generative decoder caches; a pooling model caches
only with causal attention and a pooling that leaves earlier tokens' states alone (LAST, ALL).
A bidirectional encoder (BERT and its kin) or MEAN/CLS pooling caches nothing: every token's
state there depends on the tokens after it. The engine worker leaves the choice to vLLM
(``workers.engine``), and the plan and the estimate ask the same rule of vLLM here, so a batch
on a model that caches nothing predicts no cache hits (and a cost without them) instead of the
hits a sorted plan would earn on a caching model.

The answer is vLLM's own: a ``ModelConfig`` built from the checkpoint and the model's engine
arguments (those that are ModelConfig's: ``pooler_config``, ``hf_overrides``...), once per
checkpoint and arguments in a process (about 40 ms, no engine). A checkpoint vLLM cannot describe
here predicts as a caching model did before this rule: the engine would refuse it anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from storage.checkpoint_cache import CheckpointError
from storage.registry import EMBED, SCORE, lookup
from storage.runtime import Runtime
from workers.checkpoint import checkpoint_dir

log = logging.getLogger(__name__)


@functools.cache
def _model_config_fields() -> frozenset[str]:
    from vllm.config import ModelConfig

    return frozenset(f.name for f in dataclasses.fields(ModelConfig))


@functools.lru_cache(maxsize=64)
def _supported(path: str, task: str, fields_json: str) -> bool:
    """vLLM's answer, remembered: a failure too (logged once per checkpoint and arguments)."""
    from vllm.config import ModelConfig

    runner = "pooling" if task in (EMBED, SCORE) else "generate"
    try:
        config = ModelConfig(model=path, runner=runner, **json.loads(fields_json))
        return bool(config.is_prefix_caching_supported)
    except Exception as exc:  # vLLM raises what it likes for a config it cannot read
        log.warning("could not ask vLLM whether %s caches prefixes (%s); predicting as if it does", path, exc)
        return True


def caches_prefixes(path: str, task: str, engine_args: Mapping[str, Any] | None = None) -> bool:
    """Whether an engine of the checkpoint at ``path`` (``task``: generate or embed; the model's
    ``engine_args``) keeps a prefix cache."""
    fields = {k: v for k, v in (engine_args or {}).items() if k in _model_config_fields()}
    return _supported(path, task, json.dumps(fields, sort_keys=True, default=str))


def prediction_block_size(rt: Runtime, model: str, block_size: int) -> int:
    """The KV block size that cache-hit predictions for ``model``'s requests round to: the
    engine's ``block_size``, or 0 (nothing predicted cached: ``predicted_cached_tokens``) when
    vLLM caches no prefixes for the model. An unknown model keeps ``block_size``: its requests
    fail validation anyway."""
    entry = lookup(rt.db, rt.settings, model)
    if entry is None:
        return block_size
    if entry.caches_prefixes is not None:  # asked at registration (workers/registration.py)
        return block_size if entry.caches_prefixes else 0
    try:
        path = checkpoint_dir(rt, model, entry)
    except (KeyError, CheckpointError):
        return block_size
    return block_size if caches_prefixes(path, entry.task, entry.engine_args) else 0
