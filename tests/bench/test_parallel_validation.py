"""bench/parallel_validation.py's helpers: the two input shapes it validates, and the peak memory
it reports for each control process and its pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.parallel_validation import CHAT, tree_peak_rss_mb, write_input


def test_the_two_shapes_are_the_sizes_their_results_are_reported_as(tmp_path: Path) -> None:
    rows = 400
    short = write_input(tmp_path / "short.jsonl", rows)
    docs = write_input(tmp_path / "docs.jsonl", rows, "docs")
    assert 170 <= short / rows <= 200  # "185-byte lines"
    assert 1300 <= docs / rows <= 1700  # "1.5 KB lines"
    lines = [json.loads(line) for line in (tmp_path / "docs.jsonl").read_text().splitlines()]
    assert len(lines) == rows and len({line["custom_id"] for line in lines}) == rows
    assert all(line["url"] == CHAT and line["body"]["model"] == "demo" for line in lines)
    assert [m["role"] for m in lines[0]["body"]["messages"]] == ["system", "user"]


def test_peak_memory_is_read_for_a_process_and_each_of_its_children() -> None:
    # a parent holding ~8 MB with a child holding ~64 MB; each says when it holds it
    child = "import sys; b = bytearray(64 << 20); print('child', flush=True); sys.stdin.read()"
    parent = (
        "import subprocess, sys; b = bytearray(8 << 20); "
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=subprocess.PIPE, stdout=sys.stdout); "
        "sys.stdin.read(); c.stdin.close(); c.wait()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "child"
        peaks = tree_peak_rss_mb(proc.pid)
        assert len(peaks) == 2  # the process, then its child
        assert peaks[1] >= 64 and peaks[1] > peaks[0] >= 8
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def test_the_rows_digest_is_of_the_rows_not_of_where_the_shards_cut_them(tmp_path: Path) -> None:
    from bench.parallel_validation import rows_digest
    from storage.objectstore import LocalObjectStore
    from storage.shards import ShardRow, ShardWriter

    store = LocalObjectStore(tmp_path / "objects")
    rows = [
        ShardRow(i, f"r{i}", json.dumps({"n": i}), bytes([i % 3, i]), [i, i + 1], 2, 8, i % 2)
        for i in range(10)
    ]

    def write(name: str, shards: list[list[ShardRow]]) -> list[str]:
        keys = []
        for n, part in enumerate(shards):
            key = f"{name}/{n}.parquet"
            with ShardWriter(store, key, 4) as writer:
                for row in part:
                    writer.add(row)
            keys.append(key)
        return keys

    whole = write("whole", [rows])
    # early slices: the first rows in a shard of their own, the rest in another order and cut
    # elsewhere, each row's overlap with the row before it different
    sliced = write(
        "sliced",
        [[rows[1], rows[0]], [ShardRow(**{**vars(r), "shared_tokens": 5}) for r in reversed(rows[2:])]],
    )
    assert rows_digest(store, whole) == rows_digest(store, sliced)
    changed = write("changed", [[*rows[:9], ShardRow(**{**vars(rows[9]), "body_json": '{"n": 99}'})]])
    assert rows_digest(store, changed) != rows_digest(store, whole)
    lost = write("lost", [rows[:9]])
    assert rows_digest(store, lost) != rows_digest(store, whole)
