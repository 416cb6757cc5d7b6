"""Parquet decompression bombs (issue #19, section 1): what a Parquet request file decodes to meets
the JSONL limits (rows, bytes per line, bytes per file), checked per record batch before rows
become Python objects. The bombs are built here with pyarrow: a small file whose dictionary pages
repeat one long string, and one whose compressed pages are runs of one character."""

from __future__ import annotations

import io
import json
import subprocess
import sys
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


REFUSE_AND_MEASURE = """
import sys
from pathlib import Path

from storage.parquet_limits import DecodeLimits
from storage.request_tables import request_lines


def peak_kb() -> int:
    return next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))


before = peak_kb()
lines = list(request_lines(sys.argv[1], "/v1/completions", limits=DecodeLimits(50_000, 8 << 20, 200 << 20)))
print((peak_kb() - before) / 1024, [(x.row, x.code) for x in lines if not isinstance(x, bytes)])
"""


def test_one_value_of_a_page_alone_is_refused_from_its_header(tmp_path) -> None:
    """One 64 MB string in one zstd page: a few kB that the reader decompresses whole before any
    row can be sized (it grew a process by 3 times the value). The page header states its size and
    its values, so the file is refused before decompression; a fresh process measures its peak."""
    path = tmp_path / "page-bomb.parquet"
    table = pa.table({"custom_id": ["a", "b"], "body": [body("a" * (64 * MB)), body("b")]})
    pq.write_table(table, path, compression="zstd", use_dictionary=False)
    del table
    assert path.stat().st_size < 64 * 1024
    script = subprocess.run(
        [sys.executable, "-c", REFUSE_AND_MEASURE, str(path)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, check=True,
    )  # fmt: skip
    grown, errors = script.stdout.split(" ", 1)
    assert errors.strip() == "[(1, 'line_too_large')]", script.stdout
    assert float(grown) < 100, f"refusing the bomb grew the process by {grown} MB"

    [error] = request_lines(str(path), CHAT, limits=LIMITS)
    assert isinstance(error, RowError)
    assert "column 'body': a page of 2 value(s) decompresses to" in error.message
    assert f"at the {8 * MB} byte limit on a line" in error.message


def test_a_page_larger_than_the_file_limit_is_refused_from_its_header() -> None:
    """Many values each under the line limit in one page (pyarrow puts up to 1,024 in a page)."""
    table = pa.table({"custom_id": [f"r{i}" for i in range(64)], "body": [body("a" * (MB // 2))] * 64})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", use_dictionary=False)
    limits = DecodeLimits(max_rows=100, max_line_bytes=MB, max_total_bytes=8 * MB)
    [error] = request_lines(io.BytesIO(sink.getvalue()), CHAT, limits=limits)
    assert (error.row, error.code) == (1, "file_too_large"), error
    assert f"more than the {8 * MB} byte limit on a file" in error.message


def test_dictionary_pages_no_row_refers_to_count_against_the_file() -> None:
    """Each row group's dictionary holds 7 MB of values no row uses: the rows decode to a few bytes,
    but every dictionary page is decompressed. All pages together may decompress to 8 file limits."""
    values = pa.array([body("p")] + [chr(ord("a") + k) * (900 * 1024) for k in range(8)])
    group = pa.table(
        {
            "custom_id": pa.array(["a", "b"]),
            "body": pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int32()), values),
        }
    )
    sink = io.BytesIO()
    with pq.ParquetWriter(sink, group.schema, compression="zstd") as writer:
        for _ in range(10):
            writer.write_table(group)
    limits = DecodeLimits(max_rows=100, max_line_bytes=MB, max_total_bytes=8 * MB)
    [error] = request_lines(io.BytesIO(sink.getvalue()), CHAT, limits=limits)
    assert (error.row, error.code) == (19, "file_too_large"), error  # row group 10's first row
    assert f"decompress to more than {64 * MB} bytes, 8 times the {8 * MB} byte limit" in error.message


def test_rows_over_the_line_limit_count_toward_the_file_limit() -> None:
    """A JSONL file's oversized lines are bytes of the file: so are a Parquet file's oversized rows,
    or a file of them (each in a page of small rows) would be decompressed whole, row by row."""
    rows = [body(chr(ord("a") + i // 5) * (2 * MB)) if i % 5 == 0 else body(f"s{i}") for i in range(30)]
    table = pa.table({"custom_id": [f"r{i}" for i in range(30)], "body": rows})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=5)
    limits = DecodeLimits(max_rows=100, max_line_bytes=MB, max_total_bytes=5 * MB)
    errors = [(x.row, x.code) for x in request_lines(io.BytesIO(sink.getvalue()), CHAT, limits=limits)
              if isinstance(x, RowError)]  # fmt: skip
    assert errors == [(1, "line_too_large"), (6, "line_too_large"), (11, "file_too_large")]
