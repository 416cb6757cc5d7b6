"""Prefix arithmetic over rendered prompts (lists of token ids); pure, no tokenizer or engine.

* `ideal_cache_hit_rate`: the hit rate a plan reaches at best on these prompts with KV blocks of B
  tokens: the prompts prefix-sorted as one job, each one finding cached the whole blocks it shares
  with the one before it: sum over consecutive sorted prompts of floor(lcp(prev, cur) / B) * B,
  over the total prompt tokens.
* `shared_prefix_tokens`: how many distinct tokens sit on prefixes that two or more prompts share
  (the prefix tree's shared nodes): the working set a KV cache needs to keep every shared prefix.
* `sort_order`: the order of the prompts sorted by their token id sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.unit_plan import predicted_cached_tokens


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def sort_order(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `prompts` sorted by token id sequence (stable for equal prompts)."""
    return sorted(range(len(prompts)), key=lambda i: list(prompts[i]))


def _consecutive_lcps(prompts: Sequence[Sequence[int]]) -> tuple[list[Sequence[int]], list[int]]:
    ordered = [prompts[i] for i in sort_order(prompts)]
    return ordered, [common_prefix_len(ordered[i - 1], ordered[i]) for i in range(1, len(ordered))]


def ideal_cache_hit_rate(prompts: Sequence[Sequence[int]], block_size: int) -> float:
    """Sum over consecutive sorted prompts of their shared whole blocks (at most the prompt's length
    minus one token, which vLLM always computes), over all prompt tokens."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    ordered, lcps = _consecutive_lcps(prompts)
    total = sum(len(p) for p in ordered)
    # the planner's own rule (whole blocks, never the last prompt token), so the benchmark's ideal
    # and the planned hit rate Freight reports per batch are one definition
    hits = sum(
        predicted_cached_tokens(lcp, len(cur), block_size) for lcp, cur in zip(lcps, ordered[1:], strict=True)
    )
    return hits / total if total else 0.0


def shared_prefix_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Distinct tokens on prefixes shared by two or more prompts.

    Sorted, each shared prefix is the lcp l_i of a consecutive pair; pair i adds the part of its
    prefix no earlier pair covers, which is max(0, l_i - l_{i-1})."""
    _, lcps = _consecutive_lcps(prompts)
    return sum(max(0, cur - prev) for prev, cur in zip([0, *lcps], lcps, strict=False))
