"""Parquet decompression bombs (issue #19, section 1): what a Parquet request file decodes to meets
the JSONL limits (rows, bytes per line, bytes per file), checked per record batch before rows
become Python objects. The bombs are built here with pyarrow: a small file whose dictionary pages
repeat one long string, and one whose compressed pages are runs of one character."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage.parquet_limits import DecodeLimits, row_sizes, slices
from storage.request_tables import RowError, request_lines

CHAT = "/v1/chat/completions"
MB = 1024 * 1024
LIMITS = DecodeLimits(max_rows=50_000, max_line_bytes=8 * MB, max_total_bytes=200 * MB)


def body(content: str) -> str:
    return json.dumps({"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 1})


def bomb(rows: int = 600, value_mb: int = 1, dictionary: bool = True) -> bytes:
    """``rows`` rows whose body is the same ``value_mb`` MB string: a few kB on disk."""
    long = body("a" * (value_mb * MB))
    table = pa.table({"custom_id": [f"r{i}" for i in range(rows)], "body": [long] * rows})
    sink = io.BytesIO()
    pq.write_table(
        table, sink, compression="zstd", use_dictionary=dictionary, dictionary_pagesize_limit=4 * MB
    )
    return sink.getvalue()


def peak_rss_mb(reset: bool = False) -> float:
    """This process's peak resident set (VmHWM), after resetting it to the current one if asked."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def consume(lines) -> tuple[int, list[RowError]]:
    """Lines read as validation and downloads read them, one at a time: (good lines, errors)."""
    good, errors = 0, []
    for line in lines:
        if isinstance(line, RowError):
            errors.append(line)
        else:
            good += 1
    return good, errors


def test_a_dictionary_bomb_is_refused_at_the_file_limit_without_being_decoded() -> None:
    data = bomb()
    assert len(data) < 64 * 1024  # 600 MB of requests in a few kilobytes
    before = peak_rss_mb(reset=True)
    good, [error] = consume(request_lines(io.BytesIO(data), CHAT, limits=LIMITS))
    grown = peak_rss_mb() - before
    assert good < 200  # the rows up to the limit, then the error ends the lines
    assert error.code == "file_too_large"
    assert "200 MB" not in error.message and str(200 * MB) in error.message
    assert grown < 100, f"decoding grew the process by {grown:.0f} MB"


def test_compressed_runs_of_one_value_are_sized_before_they_are_decoded() -> None:
    """Plain (not dictionary) pages of one repeated character compress ~1000x: the footer's
    uncompressed sizes cut the record batches, so a batch is about a slice whatever the rows."""
    data = bomb(rows=300, dictionary=False)
    before = peak_rss_mb(reset=True)
    _, [error] = consume(request_lines(io.BytesIO(data), CHAT, limits=LIMITS))
    assert error.code == "file_too_large"
    assert peak_rss_mb() - before < 100


def test_a_row_over_the_line_limit_is_its_own_error_and_the_rest_run() -> None:
    table = pa.table({"custom_id": ["a", "big", "c"], "body": [body("x"), body("y" * (2 * MB)), body("z")]})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    limits = DecodeLimits(max_rows=10, max_line_bytes=MB, max_total_bytes=10 * MB)
    a, big, c = request_lines(io.BytesIO(sink.getvalue()), CHAT, limits=limits)
    assert isinstance(a, bytes) and isinstance(c, bytes) and json.loads(c)["custom_id"] == "c"
    assert isinstance(big, RowError) and (big.row, big.code) == (2, "line_too_large")
    assert "row 2 is" in big.message and f"the limit is {MB}" in big.message


def test_more_rows_than_a_file_may_hold_end_the_lines() -> None:
    table = pa.table({"custom_id": [f"r{i}" for i in range(1000)], "prompt": ["p"] * 1000})
    sink = io.BytesIO()
    pq.write_table(table, sink)
    limits = DecodeLimits(max_rows=700, max_line_bytes=MB, max_total_bytes=10 * MB)
    lines = list(request_lines(io.BytesIO(sink.getvalue()), "/v1/completions", limits=limits))
    assert isinstance(lines[-1], RowError) and (lines[-1].row, lines[-1].code) == (701, "too_many_requests")
    assert len(lines) <= 701


def test_lists_whose_values_repeat_are_counted_from_the_footer() -> None:
    ids = list(range(1000))
    table = pa.table({"custom_id": [f"r{i}" for i in range(2000)], "prompt": [ids] * 2000})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    limits = DecodeLimits(max_rows=10_000, max_line_bytes=MB, max_total_bytes=MB)  # 2M values > 1 MB / 2
    [error] = list(request_lines(io.BytesIO(sink.getvalue()), "/v1/completions", limits=limits))
    assert (error.row, error.code) == (1, "file_too_large") and "2000000 values" in error.message


def test_row_sizes_count_decoded_bytes_of_every_kind_of_column() -> None:
    strings = pa.array(["ab", None, "cde"])
    assert row_sizes(strings).tolist() == [2, 0, 3]
    assert row_sizes(strings.dictionary_encode()).tolist() == [2, 0, 3]
    nested = pa.array([[{"role": "u", "content": "hello"}], [], None])
    assert row_sizes(nested).tolist() == [2 + 2 + 1 + 5, 2, 2]
    assert row_sizes(nested.slice(1)).tolist() == [2, 2]  # a sliced array counts its own rows
    assert row_sizes(pa.array([1, 2])).tolist() == [24, 24]
    assert list(slices(np.array([5, 5, 5, 20, 5]), budget=10, alone=15)) == [(0, 2), (2, 3), (3, 4), (4, 5)]
