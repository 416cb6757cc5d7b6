"""What a slice boundary costs the prefix cache (scheduler/slice_cost.py): pure arithmetic."""

from __future__ import annotations

import random

import pytest

from scheduler.ordering import adapter_key, prompt_key
from scheduler.slice_cost import SPLIT_COST_LIMIT, BoundaryCost, boundary_cost, key_tokens

BLOCK = 16


def key(*parts: list[int]) -> bytes:
    return prompt_key([t for part in parts for t in part], 1024)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def cost(keys_in_file_order: list[bytes], block: int = BLOCK) -> float:
    """The boundary cost of rows given in file order (lines 0, 1, ...), cut at their middle."""
    rows = sorted((k, line) for line, k in enumerate(keys_in_file_order))
    return boundary_cost(rows, block, len(rows) // 2)


def test_unique_prompts_lose_nothing_at_a_boundary():
    assert cost([key(tokens(i, 40)) for i in range(64)]) == 0.0


def test_one_system_prompt_over_unique_questions_loses_nothing():
    """The prompt all rows share is in use on both sides of the boundary: it stays cached."""
    system = tokens(-1, 300)
    assert cost([key(system, tokens(i, 20)) for i in range(64)]) == 0.0


def test_a_few_long_prefixes_shuffled_lose_most_of_what_sorting_saved():
    """Four documents of 300 tokens, 16 questions each, shuffled: the whole sort computes each
    document once, the halves each once per side: nearly twice the documents' tokens."""
    docs = [tokens(100 + d, 300) for d in range(4)]
    rows = [key(docs[i % 4], tokens(i, 10)) for i in range(64)]
    random.Random(7).shuffle(rows)
    cached = 300 // BLOCK * BLOCK  # of a document, in whole blocks
    whole = 4 * 310 + 60 * (310 - cached)  # each document once; then each row's uncached tail
    assert cost(rows) == pytest.approx(4 * cached / whole)  # each half computes each document
    assert cost(rows) > SPLIT_COST_LIMIT


def test_the_same_prefixes_grouped_in_file_order_cost_one_prefix_at_most():
    """Each document's questions together in the file: a boundary between groups costs
    nothing, one inside a group computes that group's document twice."""
    docs = [tokens(100 + d, 300) for d in range(4)]
    rows = [key(docs[i // 16], tokens(i, 10)) for i in range(64)]  # the cut falls between groups
    assert cost(rows) == 0.0
    nine = [tokens(200 + d, 300) for d in range(9)]
    rows = [key(nine[i * 9 // 64], tokens(i, 10)) for i in range(64)]  # rows 28-35: one group, cut
    cached = 300 // BLOCK * BLOCK
    assert cost(rows) == pytest.approx(cached / (9 * 310 + 55 * (310 - cached)))
    assert cost(rows) < SPLIT_COST_LIMIT


def test_a_model_without_prefix_caching_loses_nothing():
    docs = [tokens(100 + d, 300) for d in range(4)]
    rows = [key(docs[i % 4], tokens(i, 10)) for i in range(64)]
    random.Random(7).shuffle(rows)
    assert cost(rows, block=0) == 0.0


def test_an_adapters_marker_is_no_prompt_token():
    plain = key(tokens(1, 30))
    assert key_tokens(plain) == 30 and key_tokens(adapter_key("team-a", plain)) == 30
    assert key_tokens(b"") == 0


def test_an_empty_or_single_row_slice_costs_nothing():
    assert BoundaryCost(BLOCK, 0).extra() == 0.0
    one = BoundaryCost(BLOCK, 1)
    one.add(key(tokens(1, 300)), 0)
    assert one.extra() == 0.0 and one.rows == 1
