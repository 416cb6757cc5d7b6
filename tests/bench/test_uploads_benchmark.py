"""bench/uploads.py's own parts: the input it streams to disk and the memory sampler it reads the
API and control worker with (the benchmark itself runs the whole stack: make bench-uploads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.uploads import RssSampler, peaks, write_input


def test_the_input_is_chat_lines_for_the_demo_model_within_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    size, lines = write_input(path, 100_000)
    assert size == path.stat().st_size and 100_000 - 5_000 < size <= 100_000
    parsed = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(parsed) == lines
    assert [p["custom_id"] for p in parsed] == [f"u{i}" for i in range(lines)]
    bodies = [p["body"] for p in parsed]
    assert {(p["method"], p["url"]) for p in parsed} == {("POST", "/v1/chat/completions")}
    assert {(b["model"], b["max_tokens"]) for b in bodies} == {("demo", 1)}
    texts = [b["messages"][0]["content"] for b in bodies]
    assert len(set(texts)) == lines and all(3_000 < len(t) < 4_000 for t in texts)
    assert write_input(tmp_path / "again.jsonl", 100_000) == (size, lines)
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()  # seeded


def test_the_sampler_sums_a_process_tree_and_follows_its_children() -> None:
    sampler = RssSampler({"me": os.getpid()})
    sampler.start()
    time.sleep(0.3)
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); import time; time.sleep(1.5)"])
    try:
        time.sleep(1.2)
        sampler.stop()
        assert str(child.pid) in {name.split()[0] for name in peaks(os.getpid())}
    finally:
        child.wait()
    alone = sampler.window("me", sampler.rows[0][0], sampler.rows[1][0])
    with_child = max(sampler.window("me", sampler.rows[0][0], time.monotonic()))
    assert len(sampler.rows) >= 10  # every 0.1 s
    assert with_child - max(alone) > 60  # the child's 64 MiB counted in the tree's sum
