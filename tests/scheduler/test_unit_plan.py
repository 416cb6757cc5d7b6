"""Cutting shards into work units from their columns, and the cache hits they predict (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.ordering import prompt_key
from scheduler.unit_plan import (
    ShardColumns,
    kv_block_size,
    plan_units,
    predicted_cached_tokens,
    shared_prefix_tokens,
)


def shard(key: str, lens: list[int], budgets: list[int | None]) -> ShardColumns:
    n = len(lens)
    return ShardColumns(key, list(range(10, 10 + n)), [bytes([i]) for i in range(n)], lens, budgets)


def test_units_are_row_ranges_of_at_most_unit_size_and_never_span_shards():
    units = list(
        plan_units(
            [shard("a", [1] * 7, [None] * 7), shard("b", [2] * 3, [5] * 3)], unit_size=3, default_max_tokens=4
        )
    )
    assert [(u.shard_key, u.row_start, u.n_requests) for u in units] == [
        ("a", 0, 3), ("a", 3, 3), ("a", 6, 1), ("b", 0, 3)
    ]  # fmt: skip
    assert [u.first_line for u in units] == [10, 13, 16, 10]
    assert units[1].prefix_key == bytes([3])
    assert (units[0].prompt_tokens, units[0].output_tokens) == (3, 12)  # default budget 4 per row
    assert (units[3].prompt_tokens, units[3].output_tokens) == (6, 15)


def test_token_budget_cuts_heavy_units_and_keeps_a_large_row_alone():
    s = shard("a", [10, 10, 500, 10, 10, 10], [10] * 6)
    units = list(plan_units([s], unit_size=100, default_max_tokens=0, unit_tokens=60))
    assert [(u.row_start, u.n_requests) for u in units] == [(0, 2), (2, 1), (3, 3)]
    assert sum(u.n_requests for u in units) == 6


# --- the plan's predicted prefix-cache hits ------------------------------------------------------

sizes = st.sampled_from([16, 32, 128])


@given(shared=st.integers(-5, 5000), prompt_len=st.integers(0, 5000), block=sizes)
def test_predicted_hits_are_whole_blocks_of_at_most_the_prompt_but_its_last_token(shared, prompt_len, block):
    hit = predicted_cached_tokens(shared, prompt_len, block)
    assert 0 <= hit <= max(0, prompt_len - 1)
    assert hit <= max(0, shared)
    assert hit % block == 0
    assert hit + block > min(max(0, shared), max(0, prompt_len - 1))  # no whole block left out


# token ids: vLLM holds them as int32 (2**31 and above mark a LoRA adapter's keys: adapter_key)
@given(ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=600), block=sizes)
def test_identical_prompts_predict_all_but_the_last_partial_block(ids, block):
    key = prompt_key(ids, len(ids))
    shared = shared_prefix_tokens([key, key])
    assert shared == [0, len(ids)]  # the first request of the batch shares nothing
    assert predicted_cached_tokens(shared[1], len(ids), block) == (len(ids) - 1) // block * block


def test_predicted_hits_examples():
    assert predicted_cached_tokens(300, 1000, 128) == 256
    assert predicted_cached_tokens(1000, 1000, 128) == 896  # 999 prompt tokens at most: 7 blocks
    assert predicted_cached_tokens(1024, 1025, 128) == 1024
    assert predicted_cached_tokens(127, 1000, 128) == 0
    assert predicted_cached_tokens(5, 1, 16) == 0
    assert kv_block_size(0) == 128 and kv_block_size(16) == 16


def test_units_carry_the_predicted_hits_of_their_rows_in_batch_order():
    shared_prompt = list(range(1000, 1300))  # 300 tokens every request starts with
    keys = [prompt_key([*shared_prompt, i], 1024) for i in range(6)]
    s1 = ShardColumns("a", [1, 2, 3, 4], keys[:4], [301] * 4, [None] * 4, shared_prefix_tokens(keys[:4]))
    s2 = ShardColumns("b", [5, 6], keys[4:], [301] * 2, [None] * 2, shared_prefix_tokens(keys[4:], keys[3]))
    units = list(plan_units([s1, s2], unit_size=3, default_max_tokens=1, block_size=128))
    # the first row of the batch predicts nothing; every other shares 300 tokens: 2 blocks
    assert [(u.shard_key, u.n_requests, u.cached_tokens) for u in units] == [
        ("a", 3, 2 * 256), ("a", 1, 256), ("b", 2, 2 * 256)
    ]  # fmt: skip
    # without the column, from the (shorter) prefix keys, across shards too
    short = [k[:128] for k in keys]  # 32 tokens: shared, but not a whole 16-token block more
    s1 = ShardColumns("a", [1, 2, 3, 4], short[:4], [301] * 4, [None] * 4)
    s2 = ShardColumns("b", [5, 6], short[4:], [301] * 2, [None] * 2)
    units = list(plan_units([s1, s2], unit_size=3, default_max_tokens=1, block_size=16))
    assert [u.cached_tokens for u in units] == [2 * 32, 32, 2 * 32]


def test_unique_prompts_predict_nothing():
    keys = [prompt_key([i, *range(50)], 1024) for i in range(8)]
    s = ShardColumns("a", list(range(8)), keys, [51] * 8, [None] * 8, shared_prefix_tokens(keys))
    assert (
        sum(u.cached_tokens for u in plan_units([s], unit_size=4, default_max_tokens=1, block_size=16)) == 0
    )


def test_units_sum_their_rows_sequences_and_work():
    """Issue #49 part 4: what the quota and the fair shares count of a unit is its rows' sum."""
    s = shard("a", [5, 5, 5], [2, 2, 2])
    s = ShardColumns(s.key, s.lines, s.prefix_keys, s.prompt_lens, s.max_tokens,
                     sequences=[128, 1, 3], work=[5 + 256, 7, 11])  # fmt: skip
    [unit] = plan_units([s], unit_size=3, default_max_tokens=4)
    assert (unit.sequences, unit.work) == (132, 261 + 7 + 11)


def test_rows_of_a_shard_without_work_count_one_sequence_of_prompt_and_budget():
    [unit] = plan_units([shard("a", [5, 6], [2, None])], unit_size=2, default_max_tokens=4)
    assert (unit.sequences, unit.work) == (2, (5 + 2) + (6 + 4))
