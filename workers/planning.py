"""Planning a validated batch: read only the request store's planning columns of each shard and cut
them into work units (``scheduler.unit_plan``, pure).

``reparse`` is the JSON-only way, as planning worked before the columnar store: every body is read
back and parsed, and its prompt rendered and tokenized again, to get the same columns. It is kept
for the benchmark (``bench/parquet.py``) that measures what the columns save; production never
passes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

from scheduler.unit_plan import ShardColumns, UnitPlan, kv_block_size, plan_units, shared_prefix_tokens
from storage.objectstore import ObjectStore
from storage.settings import Settings
from storage.shards import PLAN_COLUMNS, PREFIX_KEY_BYTES, read_columns
from workers.prompt_tokens import PromptRenderer


def shard_columns(store: ObjectStore, key: str) -> ShardColumns:
    table = read_columns(store, key, PLAN_COLUMNS)
    return ShardColumns(
        key,
        table.column("line").to_pylist(),
        table.column("prefix_key").to_pylist(),
        table.column("prompt_len").to_pylist(),
        table.column("max_tokens").to_pylist(),
        table.column("shared_tokens").to_pylist(),
        # absent from shards written before they were stored: plan_units' fallback
        sequences=table.column("sequences").to_pylist() if "sequences" in table.column_names else None,
        work=table.column("work").to_pylist() if "work" in table.column_names else None,
    )


def reparsed_columns(store: ObjectStore, key: str, endpoint: str, renderer: PromptRenderer) -> ShardColumns:
    """The same columns from the bodies alone: parse each, render and tokenize its prompt again."""
    table = read_columns(store, key, ("line", "body"))
    keys, prefixes, lens, budgets = [], [], [], []
    for text in table.column("body").to_pylist():
        body = json.loads(text)
        rendered = renderer.render(endpoint, body)
        keys.append(rendered.key)
        prefixes.append(rendered.key[:PREFIX_KEY_BYTES])
        lens.append(rendered.prompt_len)
        budget = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
        budgets.append(budget if isinstance(budget, int) else None)
    # the shard's first row is taken to share nothing (the previous shard's keys are not at hand)
    shared = shared_prefix_tokens(keys)
    return ShardColumns(key, table.column("line").to_pylist(), prefixes, lens, budgets, shared)


def plan_batch(
    store: ObjectStore,
    shard_keys: Sequence[str],
    settings: Settings,
    *,
    reparse: tuple[str, PromptRenderer] | None = None,
    block_size: int | None = None,
) -> list[UnitPlan]:
    """The batch's work units, in store order; ``reparse=(endpoint, renderer)``: the JSON-only way.
    ``block_size``: what predicted cache hits round to (0: none predicted, for a model vLLM caches
    nothing for: ``workers.prefix_caching``); None: the engine's."""

    def columns() -> Iterator[ShardColumns]:
        for key in shard_keys:
            yield shard_columns(store, key) if reparse is None else reparsed_columns(store, key, *reparse)

    return list(
        plan_units(
            columns(),
            unit_size=settings.unit_size,
            default_max_tokens=settings.engine_default_max_tokens,
            unit_tokens=settings.unit_tokens,
            block_size=kv_block_size(settings.engine_block_size) if block_size is None else block_size,
        )
    )
