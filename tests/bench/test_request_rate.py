"""bench/request_rate.py's pure parts: the workload's shape and the profile summary."""

from __future__ import annotations

from bench.request_rate import OUTPUT_TOKENS, lines, per_thousand, top_functions


def test_lines_are_unique_tiny_and_seeded() -> None:
    first = lines(500, seed=1)
    assert first == lines(500, seed=1)
    assert first != lines(500, seed=2)
    prompts = [line["body"]["messages"][0]["content"] for line in first]
    assert len(set(prompts)) == 500
    assert len({line["custom_id"] for line in first}) == 500
    budgets = {line["body"]["max_tokens"] for line in first}
    assert budgets == set(range(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1))
    assert all(line["body"]["ignore_eos"] for line in first)


def test_top_functions_counts_own_and_total_samples() -> None:
    raw = "\n".join(
        [
            "main (a/run.py:1);loop (a/run.py:9);parse (b/json.py:4) 6",
            "main (a/run.py:1);loop (a/run.py:9);parse (b/json.py:5) 2",
            "main (a/run.py:1);loop (a/run.py:12) 2",
            "garbage line",
        ]
    )
    summary = top_functions(raw)
    assert summary["samples"] == 10
    assert summary["own"][0] == ("json.py:parse", 0.8)  # two lines of one function merged
    assert dict(summary["own"])["run.py:loop"] == 0.2
    assert dict(summary["total"])["run.py:main"] == 1.0


def test_cpu_per_thousand_requests() -> None:
    assert per_thousand({"control": 3.0, "api": 0.5}, 20_000) == {"control": 0.15, "api": 0.025}
    assert per_thousand({"control": 3.0}, 0) == {}
