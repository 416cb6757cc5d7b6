"""A batch's result lines in its input file's line order, in bounded memory (``?order=input``).

Why: the output and error files are in prompt-sorted order (the units' results concatenated by
``seq``, each unit's lines in the order its requests finished); users who join results back to
their inputs by position want the input's order.

How: each result line belongs to one unit, and the unit's rows in its shard give each
``custom_id``'s input line (the shards' ``line`` and ``custom_id`` columns; custom ids are unique in
a batch, validation refuses duplicates). The lines come in unit order, so one walk over the units
beside the lines finds every line's unit while holding one unit's ids (and one shard's two
columns, each shard read once). The numbered lines then go through
``scheduler.ordering.sort_records``, the external merge sort validation orders prompts with:
``INPUT_ORDER_MEMORY_BYTES`` of lines sorted in memory, sorted runs spilled to local disk beyond,
merged as they stream out.

Why an external sort and not a k-way merge of the units: each unit's lines, sorted by line number,
are a run already, but the prompt sort scatters every unit across the whole input, so a merge of
the units would hold all of them open at once: ~3,900 object-store responses for a million lines.
The sort's runs are local files of at most ``INPUT_ORDER_MEMORY_BYTES`` each, and at most 64 of
them are open per merge level.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

from scheduler.ordering import sort_records
from storage.errors import ServiceError
from storage.objectstore import ObjectStore
from storage.shards import read_columns

# lines held per download (an API process serves up to 8 at once: 2 workers of 4 threads); the
# sort counts each line with 160 bytes of overhead. A million 790-byte lines make ~25 runs, one merge level.
# At 64 MiB a million-line download grew the API 104.3 MB (bench/results/input_order.json, af6a2ef)
INPUT_ORDER_MEMORY_BYTES = 32 * 1024 * 1024

# a result line as workers.results.encode writes it: its id first, then its custom_id
_HEAD = re.compile(rb'\{"id":"[^"\\]*","custom_id":"')


class UnitRows(Protocol):
    """What the walk needs of a unit (a ``WorkUnit`` row, or a selected row of its columns)."""

    shard_key: str
    row_start: int
    n_requests: int


def line_custom_id(raw: bytes) -> str:
    """A result line's ``custom_id``: read in place when the line starts as Freight writes it
    (``{"id":"…","custom_id":"…"``, no escapes in the id), else parsed whole."""
    head = _HEAD.match(raw)
    if head is not None:
        end = raw.find(b'"', head.end())
        value = raw[head.end() : end]
        if end > 0 and b"\\" not in value:
            return value.decode()
    custom_id = json.loads(raw).get("custom_id")
    if not isinstance(custom_id, str):
        raise ValueError(f"a result line without a custom_id: {raw[:200]!r}")
    return custom_id


class _ShardLines:
    """Each unit's ``custom_id -> input line``, from its shard's two columns read once per shard
    (units in seq order come shard after shard)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.key: str | None = None
        self.ids: list[str] = []
        self.lines: list[int] = []

    def of(self, unit: UnitRows) -> dict[str, int]:
        if unit.shard_key != self.key:
            table = read_columns(self.store, unit.shard_key, ("line", "custom_id"))
            self.ids = table.column("custom_id").to_pylist()
            self.lines = table.column("line").to_pylist()
            self.key = unit.shard_key
        end = unit.row_start + unit.n_requests
        return dict(zip(self.ids[unit.row_start : end], self.lines[unit.row_start : end], strict=True))


def numbered_lines(
    store: ObjectStore, units: Iterable[UnitRows], lines: Iterable[bytes]
) -> Iterator[tuple[int, bytes]]:
    """``(input line number, line)`` of result lines (without their newline) that come in the order
    of ``units``: each unit's lines together, units in seq order, a unit with no line here skipped.
    A line of no later unit (a file not made of these units' results) is a ServiceError."""
    shards = _ShardLines(store)
    todo = iter(units)
    current: dict[str, int] = {}
    for raw in lines:
        if not raw.strip():
            continue
        custom_id = line_custom_id(raw)
        while (number := current.pop(custom_id, None)) is None:
            unit = next(todo, None)
            if unit is None:
                raise ServiceError(
                    "invalid_request",
                    f"custom_id {custom_id[:100]!r} is not a request of this batch's units in their "
                    "order, so its input order cannot be worked out",
                    param="order",
                    code="input_order_unavailable",
                )
            current = shards.of(unit)
        yield number, raw


def in_input_order(
    store: ObjectStore,
    units: Iterable[UnitRows],
    lines: Iterable[bytes],
    spill_dir: str | Path,
    memory_bytes: int | None = None,
) -> Iterator[bytes]:
    """The result ``lines`` (in unit order, see ``numbered_lines``) in input line order, each with
    its newline. Reads them all before the first is yielded (the sort), spilling beyond
    ``memory_bytes`` (``INPUT_ORDER_MEMORY_BYTES``); the spill files go when the iterator ends or
    is closed."""
    records = ((b"", number, raw) for number, raw in numbered_lines(store, units, lines))
    budget = INPUT_ORDER_MEMORY_BYTES if memory_bytes is None else memory_bytes
    ordered = sort_records(records, memory_bytes=budget, spill_dir=spill_dir)
    try:
        for _, _, raw in ordered:
            yield raw + b"\n"
    finally:
        ordered.close()
