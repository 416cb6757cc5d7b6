"""bench/prefix.py: the plan's ideal cache hit rate and the shared prefix size (pure)."""

from __future__ import annotations

import pytest

from bench.prefix import common_prefix_len, ideal_cache_hit_rate, shared_prefix_tokens, sort_order


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


def test_sort_order_is_by_token_sequence() -> None:
    prompts = [[3, 1], [1, 2, 3], [1, 2], [2]]
    assert sort_order(prompts) == [2, 1, 3, 0]


def test_ideal_hit_rate_counts_whole_blocks_of_consecutive_sorted_prompts() -> None:
    a = list(range(10))  # two prompts sharing 9 tokens, a third sharing 5 with them
    b = [*range(9), 99]
    c = [*range(5), 50, 51]
    # sorted: a, b (lcp 9), c (lcp with b 5) -> blocks of 4: 8 + 4 hits over 27 tokens
    assert ideal_cache_hit_rate([c, b, a], 4) == pytest.approx(12 / 27)
    assert ideal_cache_hit_rate([c, b, a], 1) == pytest.approx(14 / 27)
    assert ideal_cache_hit_rate([c, b, a], 16) == 0.0


def test_ideal_hit_rate_does_not_depend_on_input_order() -> None:
    prompts = [[1, 1, 1, 1, 2], [2, 2, 2, 2], [1, 1, 1, 1, 3], [2, 2, 2, 2, 5]]
    rate = ideal_cache_hit_rate(prompts, 2)
    assert rate == pytest.approx((4 + 4) / 19)
    assert ideal_cache_hit_rate(list(reversed(prompts)), 2) == rate


def test_ideal_hit_rate_edges() -> None:
    assert ideal_cache_hit_rate([], 32) == 0.0
    assert ideal_cache_hit_rate([[1, 2, 3]], 1) == 0.0  # one prompt: nothing before it
    with pytest.raises(ValueError):
        ideal_cache_hit_rate([[1]], 0)


def test_shared_prefix_tokens_counts_each_shared_node_once() -> None:
    # a prefix [1]*6 shared by three prompts, inside it [1]*8 shared by two, and a lone prompt
    prompts = [[1] * 6 + [2], [1] * 8 + [3], [1] * 8 + [4], [9, 9]]
    assert shared_prefix_tokens(prompts) == 8
    assert shared_prefix_tokens([[1, 2], [3, 4]]) == 0
    two_groups = [[1, 1, 1, 5], [1, 1, 1, 6], [2, 2, 7], [2, 2, 8]]
    assert shared_prefix_tokens(two_groups) == 5
