"""What a slice boundary costs the prefix cache: whether an early slice may start (pure).

Why: an early slice of a validation (``workers.head_start``) is sorted by prompt within itself,
so a prefix that rows on both sides of a slice boundary share is computed once on each side,
unless the KV cache still holds it when the later side runs. Under a tight cache it does not: a
run of the scheduler's document Q&A workload at 16k tokens of KV cache, slices on, ran at 0.73 of
the engine on the sorted lines against 1.00 with them off (its hit rate 81% against 85%; the
closing note of 2026-11-29). A prefix every row shares (a system prompt) is in use on both sides
of a boundary and stays cached, so it costs nothing.

The estimate, over the rows of the first slice (the one decision a validation makes): cut them
at their middle line into the two halves a boundary would make, sort each half apart, and count
the prompt tokens vLLM would compute (the tokens not predicted cached, as unit planning predicts
them: shared with the row before, in whole KV blocks) against the rows sorted whole; less the
blocks of the prefix all the rows share. ``extra`` is that excess over the whole sort's computed
tokens; a slice starts only below ``SPLIT_COST_LIMIT``. Prompt keys hold the first
``sort_key_tokens`` tokens only: tokens past them count as neither shared nor computed, which
makes the estimate err high (towards keeping the whole-file sort).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.ordering import ADAPTER_MARKER_BYTE, KEY_TOKEN_BYTES, common_prefix_tokens
from scheduler.unit_plan import predicted_cached_tokens

SPLIT_COST_LIMIT = 0.1
"""The most extra prefill, as a share of the whole sort's, that a boundary may cost for slices
to start. A few distinct prefixes among many rows (few-shot prompts, documents asked several
questions, images asked several things) cost 25-50% at a boundary; unique prompts under one
system prompt cost nothing; a tenth leaves room for a couple of templates that stay cached."""


def key_tokens(key: bytes) -> int:
    """The prompt tokens a key holds (an adapter's marker is none of them)."""
    n = len(key) // KEY_TOKEN_BYTES
    return n - 1 if n and key[0] >= ADAPTER_MARKER_BYTE else n


@dataclass
class BoundaryCost:
    """Fed the rows of one slice in sorted order (``add``); ``extra`` is what cutting them at
    ``mid_line`` (rows before it on one side) costs. ``block_size``: the engine's KV block in
    tokens, 0 where the model caches no prefixes (then nothing is shared and nothing lost)."""

    block_size: int
    mid_line: int
    whole: int = 0  # prompt tokens computed, the rows sorted whole
    split: int = 0  # the same, each half sorted apart
    rows: int = 0
    _previous: bytes | None = None
    _halves: list[bytes | None] = field(default_factory=lambda: [None, None])
    _first: bytes | None = None

    def add(self, key: bytes, line: int) -> None:
        tokens = key_tokens(key)
        self.whole += tokens - self._cached(self._previous, key, tokens)
        half = 0 if line < self.mid_line else 1
        self.split += tokens - self._cached(self._halves[half], key, tokens)
        self._previous = self._halves[half] = key
        if self._first is None:
            self._first = key
        self.rows += 1

    def _cached(self, previous: bytes | None, key: bytes, tokens: int) -> int:
        if previous is None:
            return 0
        return predicted_cached_tokens(common_prefix_tokens(previous, key), tokens, self.block_size)

    def extra(self) -> float:
        """The halves' computed tokens over the whole's, less one, after the shared prefix's
        blocks (computed again by the second half's first row, but held by rows running then)."""
        if self.whole <= 0 or self._first is None or self._previous is None:
            return 0.0
        common = common_prefix_tokens(self._first, self._previous)  # sorted: first and last bound it
        hot = predicted_cached_tokens(common, common + 1, self.block_size)
        return max(0, self.split - self.whole - hot) / self.whole


def boundary_cost(records: Iterable[tuple[bytes, int]], block_size: int, mid_line: int) -> float:
    """``BoundaryCost.extra`` of ``(key, line)`` pairs in sorted order."""
    cost = BoundaryCost(block_size, mid_line)
    for key, line in records:
        cost.add(key, line)
    return cost.extra()
