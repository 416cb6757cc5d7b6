"""Cutting shards into work units from their columns (pure)."""

from __future__ import annotations

from scheduler.unit_plan import ShardColumns, plan_units


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
