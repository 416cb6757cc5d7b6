"""Cutting a validated batch into work units, from the request store's columns (pure).

Validation writes the batch's requests in prompt-prefix order into shards; planning reads only the
small columns it needs of each shard (line, prefix key, prompt length, output budget) and cuts each
shard into units: contiguous row ranges of at most ``unit_size`` requests and, when ``unit_tokens``
is set, at most that many planned tokens (prompt + output budget; a single larger request is a
unit of its own), so a unit of long prompts is not as heavy as many of short ones. A unit never
spans shards; a worker reads its rows by shard and row range.

Each unit also carries the prefix-cache hits the sorted order predicts (``predicted_cached_tokens``):
what vLLM should report as cached if every request found its predecessor's blocks still cached;
and its rows' summed ``sequences`` and ``work`` (``scheduler.request_work``), what the queued-requests
quota and the fair shares count of it. A shard written before those columns existed counts each
row as one sequence of its prompt plus its output budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from scheduler.ordering import common_prefix_tokens

CPU_BLOCK_SIZE = 128
"""vLLM's KV block size on CPU when none is configured."""


def kv_block_size(configured: int) -> int:
    """The engine's KV block size in tokens: the configured one, or 128 when it is 0 (vLLM's CPU
    default). GPU's default is 16, so on GPUs ``engine_block_size`` should be set, or predictions
    are rounded to blocks 8x too large."""
    return configured if configured > 0 else CPU_BLOCK_SIZE


def predicted_cached_tokens(shared_tokens: int, prompt_len: int, block_size: int) -> int:
    """The prompt tokens of a request that vLLM's prefix cache should serve, given that it shares
    ``shared_tokens`` leading tokens with the request run just before it: the shared part in whole
    KV blocks (only full blocks are cached), and never the last prompt token (vLLM always computes
    it, to get the first output token's logits), so at most ``prompt_len - 1`` rounded down.

    ``shared_tokens`` comes from the requests' sort keys, which hold only the first
    ``sort_key_tokens`` prompt tokens: prompts sharing more than that predict at most that many.
    """
    if block_size <= 0 or shared_tokens <= 0 or prompt_len <= 1:
        return 0
    return min(shared_tokens, prompt_len - 1) // block_size * block_size


def shared_prefix_tokens(keys: Iterable[bytes], previous: bytes | None = None) -> list[int]:
    """For each prompt key in order, how many leading tokens it shares with the one before it
    (``previous`` before the first; None: the first shares nothing)."""
    shared = []
    for key in keys:
        shared.append(0 if previous is None else common_prefix_tokens(previous, key))
        previous = key
    return shared


@dataclass(frozen=True)
class ShardColumns:
    """What planning reads of one shard: one entry per row, in the shard's order."""

    key: str
    lines: Sequence[int]
    prefix_keys: Sequence[bytes]
    prompt_lens: Sequence[int]
    max_tokens: Sequence[int | None]
    # tokens each row's full sort key shares with the previous row's in the batch (the shard's
    # ``shared_tokens`` column); None: worked out from ``prefix_keys`` (shorter keys, smaller hits)
    shared_tokens: Sequence[int] | None = None
    # each row's outputs asked for and its work (scheduler.request_work); None: not stored
    sequences: Sequence[int | None] | None = None
    work: Sequence[int | None] | None = None


@dataclass(frozen=True)
class UnitPlan:
    shard_key: str
    row_start: int
    n_requests: int
    first_line: int
    prefix_key: bytes  # the first row's, for packing
    prompt_tokens: int  # planned: the rows' prompt lengths
    output_tokens: int  # planned: their output budgets (the default where a row has none)
    cached_tokens: int = 0  # predicted prefix-cache hits of the rows (``predicted_cached_tokens``)
    sequences: int = 0  # the rows' outputs asked for (n, inputs, pairs)
    work: int = 0  # the rows' work: their weight in the fair shares


def plan_units(
    shards: Iterable[ShardColumns],
    *,
    unit_size: int,
    default_max_tokens: int,
    unit_tokens: int = 0,
    block_size: int = CPU_BLOCK_SIZE,
) -> Iterator[UnitPlan]:
    """Units in store order (the order of their ``seq``); ``block_size``: the engine's KV block, for
    the predicted cache hits (the first row of the batch predicts none)."""
    size = max(1, unit_size)
    previous: bytes | None = None  # the last prefix key of the shards before, for the fallback
    for shard in shards:
        shared = shard.shared_tokens
        if shared is None:
            shared = shared_prefix_tokens((bytes(k or b"") for k in shard.prefix_keys), previous)
        if len(shard.prefix_keys):
            previous = bytes(shard.prefix_keys[-1] or b"")
        start = 0
        n = prompt = output = cached = sequences = work = 0
        for row in range(len(shard.lines)):
            row_prompt = int(shard.prompt_lens[row] or 0)
            budget = shard.max_tokens[row]
            row_output = default_max_tokens if budget is None else int(budget)
            heavy = unit_tokens > 0 and prompt + output + row_prompt + row_output > unit_tokens
            if n and (n >= size or heavy):
                yield _unit(shard, start, n, prompt, output, cached, sequences, work)
                start, n, prompt, output, cached, sequences, work = row, 0, 0, 0, 0, 0, 0
            n += 1
            prompt += row_prompt
            output += row_output
            cached += predicted_cached_tokens(int(shared[row] or 0), row_prompt, block_size)
            row_sequences = None if shard.sequences is None else shard.sequences[row]
            row_work = None if shard.work is None else shard.work[row]
            sequences += int(row_sequences or 1)
            work += int(row_work) if row_work else max(1, row_prompt + row_output)
        if n:
            yield _unit(shard, start, n, prompt, output, cached, sequences, work)


def _unit(
    shard: ShardColumns, start: int, n: int, prompt: int, output: int, cached: int, sequences: int, work: int
) -> UnitPlan:
    return UnitPlan(
        shard.key,
        start,
        n,
        int(shard.lines[start]),
        bytes(shard.prefix_keys[start] or b""),
        prompt,
        output,
        cached,
        sequences,
        work,
    )
