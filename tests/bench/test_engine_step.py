"""bench/engine_step.py's lines: the shape the benchmark claims (distinct prompts, a fixed greedy
output), the same file for the same seed, other prompts for the warm-up's."""

from __future__ import annotations

import json
from pathlib import Path

from bench.engine_step import SYSTEMS, write_lines


def read(path: Path) -> list[dict]:
    return [json.loads(line)["body"] for line in path.read_text().splitlines()]


def test_lines_are_distinct_greedy_and_fixed_length(tmp_path: Path) -> None:
    write_lines(tmp_path / "a.jsonl", 200, 64, seed=1)
    write_lines(tmp_path / "b.jsonl", 200, 64, seed=1)
    write_lines(tmp_path / "warm.jsonl", 50, 64, seed=2)
    bodies = read(tmp_path / "a.jsonl")
    assert bodies == read(tmp_path / "b.jsonl")  # seeded: every system runs the very same file
    prompts = [b["messages"][0]["content"] for b in bodies]
    assert len(set(prompts)) == 200  # no prefix cache hits between lines beyond the template
    assert all(
        b["max_tokens"] == b["min_tokens"] == 64 and b["ignore_eos"] and b["temperature"] == 0 for b in bodies
    )
    assert not set(prompts) & {b["messages"][0]["content"] for b in read(tmp_path / "warm.jsonl")}
    assert len(SYSTEMS) == 3 and SYSTEMS[0] == "limit"
