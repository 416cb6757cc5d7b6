"""Cutting a validated batch into work units, from the request store's columns (pure).

Validation writes the batch's requests in prompt-prefix order into shards; planning reads only the
small columns it needs of each shard (line, prefix key, prompt length, output budget) and cuts each
shard into units: contiguous row ranges of at most ``unit_size`` requests and, when ``unit_tokens``
is set, at most that many planned tokens (prompt + output budget; a single larger request is a
unit of its own), so a unit of long prompts is not as heavy as many of short ones. A unit never
spans shards; a worker reads its rows by shard and row range.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardColumns:
    """What planning reads of one shard: one entry per row, in the shard's order."""

    key: str
    lines: Sequence[int]
    prefix_keys: Sequence[bytes]
    prompt_lens: Sequence[int]
    max_tokens: Sequence[int | None]


@dataclass(frozen=True)
class UnitPlan:
    shard_key: str
    row_start: int
    n_requests: int
    first_line: int
    prefix_key: bytes  # the first row's, for packing
    prompt_tokens: int  # planned: the rows' prompt lengths
    output_tokens: int  # planned: their output budgets (the default where a row has none)


def plan_units(
    shards: Iterable[ShardColumns], *, unit_size: int, default_max_tokens: int, unit_tokens: int = 0
) -> Iterator[UnitPlan]:
    """Units in store order (the order of their ``seq``)."""
    size = max(1, unit_size)
    for shard in shards:
        start = 0
        n = prompt = output = 0
        for row in range(len(shard.lines)):
            row_prompt = int(shard.prompt_lens[row] or 0)
            budget = shard.max_tokens[row]
            row_output = default_max_tokens if budget is None else int(budget)
            heavy = unit_tokens > 0 and prompt + output + row_prompt + row_output > unit_tokens
            if n and (n >= size or heavy):
                yield _unit(shard, start, n, prompt, output)
                start, n, prompt, output = row, 0, 0, 0
            n += 1
            prompt += row_prompt
            output += row_output
        if n:
            yield _unit(shard, start, n, prompt, output)


def _unit(shard: ShardColumns, start: int, n: int, prompt: int, output: int) -> UnitPlan:
    return UnitPlan(
        shard.key, start, n, int(shard.lines[start]), bytes(shard.prefix_keys[start] or b""), prompt, output
    )
