"""Result lines in input order (storage/result_order.py): each line's input line found by walking
the units beside the lines, then an external sort that spills past its memory budget."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from storage.errors import ServiceError
from storage.objectstore import LocalObjectStore
from storage.result_order import in_input_order, line_custom_id, numbered_lines
from storage.shards import ShardRow, ShardWriter
from workers.results import encode, request_error_line, success_line


@dataclass(frozen=True)
class Unit:
    shard_key: str
    row_start: int
    n_requests: int


def sharded(
    store: LocalObjectStore, n: int, unit_size: int, units_per_shard: int
) -> tuple[list[Unit], list[str]]:
    """``n`` requests r-0 … (input lines 1 … n) stored shuffled (as the prompt sort leaves them) in
    shards of ``units_per_shard`` units; the units and the custom ids in stored order."""
    order = list(range(n))
    random.Random(7).shuffle(order)
    units, stored = [], []
    per_shard = unit_size * units_per_shard
    for s, start in enumerate(range(0, n, per_shard)):
        key = f"shards/{s:03d}.parquet"
        chunk = order[start : start + per_shard]
        with ShardWriter(store, key, unit_size) as writer:
            for i in chunk:
                writer.add(ShardRow(i + 1, f"r-{i}", "{}"))
        stored += [f"r-{i}" for i in chunk]
        units += [Unit(key, r, min(unit_size, len(chunk) - r)) for r in range(0, len(chunk), unit_size)]
    return units, stored


def test_a_lines_custom_id_is_read_in_place_or_parsed():
    assert line_custom_id(encode(success_line("plain-1", {"a": 1}))[:-1]) == "plain-1"
    escaped = encode(success_line('quote"and\\slash é', {"a": 1}))[:-1]
    assert line_custom_id(escaped) == 'quote"and\\slash é'
    reordered = json.dumps({"custom_id": "late", "id": "x"}).encode()  # not Freight's field order
    assert line_custom_id(reordered) == "late"
    with pytest.raises(ValueError):
        line_custom_id(b'{"id": "x"}')


def test_lines_come_back_in_input_order_with_their_bytes_through_spilled_runs(tmp_path: Path):
    store = LocalObjectStore(tmp_path / "store")
    units, stored = sharded(store, 3_000, unit_size=16, units_per_shard=8)
    # each unit's lines in the order its requests finished, some in the error file
    rng = random.Random(3)
    output, errors = [], []
    offset = 0
    for u in units:
        ids = stored[offset : offset + u.n_requests]
        offset += u.n_requests
        rng.shuffle(ids)
        for cid in ids:
            if cid.endswith("7"):
                errors.append(encode(request_error_line(cid, 400, {"message": "no"}))[:-1])
            else:
                output.append(encode(success_line(cid, {"text": "x" * rng.randrange(10, 400)}))[:-1])
    spill = tmp_path / "spill"
    spill.mkdir()
    ordered = list(in_input_order(store, units, iter(output), spill, memory_bytes=64 * 1024))
    expected = sorted(output, key=lambda raw: int(line_custom_id(raw)[2:]))
    assert ordered == [raw + b"\n" for raw in expected]  # the same bytes, each line once
    assert not list(spill.iterdir())  # the spilled runs are gone
    assert [line_custom_id(x) for x in in_input_order(store, units, iter(errors), spill)] == sorted(
        (line_custom_id(x) for x in errors), key=lambda c: int(c[2:])
    )


def test_numbered_lines_skip_units_without_lines_and_refuse_lines_out_of_unit_order(tmp_path: Path):
    store = LocalObjectStore(tmp_path / "store")
    units, stored = sharded(store, 64, unit_size=8, units_per_shard=4)
    last_unit = stored[-8:]  # only the last unit has lines here
    lines = [encode(success_line(cid, {}))[:-1] for cid in last_unit]
    assert [n for n, _ in numbered_lines(store, units, lines)] == [int(c[2:]) + 1 for c in last_unit]
    backwards = [encode(success_line(stored[-1], {}))[:-1], encode(success_line(stored[0], {}))[:-1]]
    with pytest.raises(ServiceError) as refused:
        list(numbered_lines(store, units, backwards))
    assert refused.value.code == "input_order_unavailable" and refused.value.param == "order"
