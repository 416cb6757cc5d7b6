"""Parquet bombs through list columns (issue #19, section 1): one row holding millions of list
values whose repetition levels and dictionary indices are runs (a few bytes of page for any
number of values), and files of very many pages. Refused from the page headers and the levels
before anything is decoded; files near the limits are accepted."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from storage.parquet_limits import DecodeLimits, max_pages, max_runs
from storage.parquet_pages import DATA_PAGE_V2, Page, TooManyRuns, pages, row_values
from storage.request_tables import RowError, request_lines
from tests.storage.test_parquet_limits import peak_rss_mb

MB = 1024 * 1024
LIMITS = DecodeLimits(max_rows=50_000, max_line_bytes=8 * MB, max_total_bytes=200 * MB)  # defaults


def repeated(counts: list[int], entry: str) -> pa.ListArray:
    """Lists of ``counts`` values, every one the dictionary's single ``entry`` (no string copied)."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = pa.DictionaryArray.from_arrays(pa.array(np.zeros(offsets[-1], np.int32)), pa.array([entry]))
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def list_bomb(kind: str, n: int, before: int = 0, version: str = "1.0") -> tuple[bytes, int]:
    """``before`` rows of 3 values, then one row of ``n``: the file, and what that row decodes to."""
    counts = [3] * before + [n] + [3] * 10
    if kind == "messages":  # list<struct<role, content>>, both dictionary-encoded
        roles, contents = repeated(counts, "user"), repeated(counts, "c" * 40)
        structs = pa.StructArray.from_arrays([roles.values, contents.values], ["role", "content"])
        column = pa.ListArray.from_arrays(roles.offsets, structs)
        element = len('{"role":"user","content":""},') + 40
        name = "messages"
    else:  # list<string>: a prompt of strings
        column, element, name = repeated(counts, "p" * 60), 63, "prompt"
    table = pa.table({"custom_id": [f"r{i}" for i in range(len(counts))], name: column})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", data_page_version=version)
    return sink.getvalue(), n * element


@pytest.mark.parametrize(
    ("kind", "n", "before", "version"),
    [
        ("prompt", 40_000_000, 0, "1.0"),  # the row alone: its row group's values say it
        ("messages", 20_000_000, 0, "1.0"),
        ("prompt", 40_000_000, 500, "1.0"),  # among 510 small rows: only its levels say it
        ("messages", 20_000_000, 500, "2.0"),
        ("prompt", 3_000_000, 0, "1.0"),  # just over the line limit at 3 bytes a value
    ],
)
def test_a_row_of_millions_of_run_encoded_list_values_is_refused_before_decoding(
    kind: str, n: int, before: int, version: str
) -> None:
    data, decoded = list_bomb(kind, n, before, version)
    assert len(data) < 4096 and decoded > 100 * MB
    grown_before = peak_rss_mb(reset=True)
    started = time.perf_counter()
    lines = list(request_lines(io.BytesIO(data), "/v1/completions", limits=LIMITS))
    took = time.perf_counter() - started
    grown = peak_rss_mb() - grown_before
    assert isinstance(lines[-1], RowError), lines[-1]
    error = lines[-1]
    assert (error.row, error.code) == (before + 1, "line_too_large"), error
    assert f"the limit is {8 * MB}" in error.message or f"{8 * MB} byte limit on a line" in error.message
    assert all(isinstance(line, bytes) for line in lines[:-1]) and len(lines) <= before + 1
    assert grown < 100, f"refusing a {len(data)} byte file of {decoded} decoded bytes grew {grown:.0f} MB"
    assert took < 5


def lists_file(lengths: list[int], options: dict) -> bytes:
    """Rows of list<struct<role, content>> and list<list<int>> of the given lengths (a null row where
    the length is negative), written with ``options``."""
    messages = [
        None if k < 0 else [{"role": "user", "content": f"m{i % 3}" if i % 5 else None} for i in range(k)]
        for k in lengths
    ]
    nested = [None if k < 0 else [[j % 4] * (j % 3) for j in range(k)] for k in lengths]
    # typed: a file whose rows are all null would otherwise be read as a null column, not a list
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {
            "messages": pa.array(messages, pa.list_(message)),
            "ids": pa.array(nested, pa.list_(pa.list_(pa.int64()))),
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, **options)
    return sink.getvalue()


WRITES = [
    {},
    {"data_page_version": "2.0", "compression": "gzip"},
    {"use_dictionary": False, "compression": "snappy", "data_page_size": 256},
    {"compression": "lz4", "row_group_size": 10_000, "write_batch_size": 7},
    {"compression": "brotli", "data_page_size": 64, "data_page_version": "2.0"},
    {"compression": "none", "max_rows_per_page": 3},
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.one_of(st.integers(-1, 40), st.integers(200, 3000)), min_size=1, max_size=60),
    options=st.sampled_from(WRITES),
    rows=st.integers(0, 70),
)
@example(lengths=[-1], options=WRITES[1], rows=1)  # every row null: still a list column (found once)
def test_rows_are_counted_from_their_repetition_levels(lengths: list[int], options: dict, rows: int) -> None:
    """For every leaf of every list column, the values of each row (of the first ``rows``) are what
    the data says (a null or empty list takes one value, as the levels store it)."""
    data = lists_file(lengths, options)
    pf = pq.ParquetFile(io.BytesIO(data))
    found = list(pages(io.BytesIO(data), pf.metadata))
    for i in range(len(pf.schema)):
        column = pf.schema.column(i)
        chunk = [p for p in found if p.column == column.path]
        compression = pf.metadata.row_group(0).column(i).compression
        if column.path.startswith("ids"):  # a row's values: its inner values, or 1 per empty list
            counts = [max(1, sum(max(1, j % 3) for j in range(k))) for k in lengths]
        else:
            counts = [max(1, k) for k in lengths]
        got, runs = row_values(io.BytesIO(data), chunk, compression, column.max_repetition_level, rows, 10**6)
        assert runs <= len(lengths) * 2 + sum(max(0, k) for k in lengths) // 8 + 20
        assert got.tolist() == (counts + [0] * rows)[:rows], column.path


def test_a_row_past_the_line_limit_across_several_list_columns_is_refused() -> None:
    """Each of 4 list columns holds 2 million values in one row (6 MB at least, under the line
    limit alone): the row's values, summed over its columns, pass it."""
    counts = [3] * 300 + [2_000_000] + [3] * 300
    table = pa.table(
        {"custom_id": [f"r{i}" for i in range(len(counts))]}
        | {name: repeated(counts, "v" * 20) for name in ("prompt", "stop", "a", "b")}
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    del table
    before = peak_rss_mb(reset=True)
    lines = list(request_lines(io.BytesIO(sink.getvalue()), "/v1/completions", limits=LIMITS))
    grown = peak_rss_mb() - before
    assert len(sink.getvalue()) < 8192 and grown < 100, grown
    error = lines[-1]
    assert isinstance(error, RowError) and (error.row, error.code) == (301, "line_too_large"), error
    assert "holds 2000000 list values" in error.message and "at least 23999988 bytes" in error.message


def near_limit_files() -> list[tuple[str, Callable[[], pa.Table]]]:
    """Legitimate tables close to LIMITS (8 MB a line, 200 MB a file, 50,000 rows), each made only
    by the test that reads it (the largest take seconds to build)."""
    per_row = 7 * MB // len('{"role":"user","content":""},' + "c" * 100)  # 7 MB of JSON
    return [
        ("a row of many identical messages, near the line limit",
         lambda: pa.table({"custom_id": ["one"], "messages": [[{"role": "user", "content": "c" * 100}] * per_row]})),
        ("long repeated strings, near the file limit",
         lambda: pa.table({"custom_id": [f"r{i}" for i in range(30)], "prompt": [["x" * 2000] * 3000] * 30})),
        ("rows of 200,000 token ids: their row group could hold a row past the line limit",
         lambda: pa.table({"custom_id": [f"t{i}" for i in range(30)],
                           "prompt": [list(range(i, i + 200_000)) for i in range(30)]})),
        ("rows of 30,000 short messages, 3 million values in the row group",
         lambda: pa.table({"custom_id": [f"s{i}" for i in range(100)],
                           "messages": [[{"role": "user", "content": "q"}] * 30_000] * 100})),
        ("many rows of a few messages",
         lambda: pa.table({"custom_id": [f"m{i}" for i in range(45_000)],
                           "messages": [[{"role": "user", "content": f"q{i}"}] * (1 + i % 3) for i in range(45_000)]})),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("index", "version"), [(i, v) for i in range(5) for v in ("1.0", "2.0") if (i, v) != (3, "2.0")]
)  # 3 million messages in one version is enough (20 s)
def test_legitimate_files_near_the_limits_are_accepted(index: int, version: str) -> None:
    what, build = near_limit_files()[index]
    table = build()
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", data_page_version=version)
    good = 0
    for line in request_lines(io.BytesIO(sink.getvalue()), "/v1/chat/completions", limits=LIMITS):
        assert isinstance(line, bytes), (what, line)
        assert len(line) <= LIMITS.max_line_bytes, what
        good += 1
    assert good == table.num_rows, what


def test_a_file_of_very_many_pages_is_refused_quickly() -> None:
    """A page per value (pyarrow writes one if told to): about 2,000,000 page headers in 58 MB.
    Reading a header costs about 10 microseconds; the file is refused at max_pages."""
    n = 1_000_000
    table = pa.table({"custom_id": pa.array(np.zeros(n, np.int8)), "prompt": pa.array(np.zeros(n, np.int8))})
    sink = io.BytesIO()
    pq.write_table(
        table, sink, use_dictionary=False, compression="none", data_page_size=1, write_batch_size=1,
        write_statistics=False, row_group_size=n,
    )  # fmt: skip
    started = time.perf_counter()
    [error] = request_lines(io.BytesIO(sink.getvalue()), "/v1/completions", limits=LIMITS)
    took = time.perf_counter() - started
    assert isinstance(error, RowError) and (error.row, error.code) == (1, "file_too_large"), error
    assert f"more than {max_pages(LIMITS)} pages" in error.message and max_pages(LIMITS) == 51_200
    # reading all ~2,000,000 headers took 33 s; refused at max_pages, 0.5 s alone and 3.2 s beside
    # the live stacks of make test's other process: the bound sits well between the two
    assert took < 10, f"refusing the file took {took:.1f} s"


def test_json_of_an_accepted_row_is_what_was_written() -> None:
    data, _ = list_bomb("messages", 1000)
    lines = list(request_lines(io.BytesIO(data), "/v1/chat/completions", limits=LIMITS))
    first = json.loads(lines[0])["body"]["messages"]
    assert len(first) == 1000 and first[0] == {"role": "user", "content": "c" * 40}


def test_repetition_levels_are_counted_within_a_budget_of_runs() -> None:
    """Counting levels costs time per run (2 to 20 microseconds): past the runs a caller allows,
    TooManyRuns. A writer's file stays within max_runs (two a row, one per RUN_BYTES of the file
    limit); these are hand-made levels of a data page v2, a row of 8 values per bit-packed run."""
    levels = bytes([0x03, 0b11111110]) * 5000
    page = Page(0, "p", len(levels), len(levels), 8 * 5000, DATA_PAGE_V2, 5000, 0, None, len(levels))
    counts, runs = row_values(io.BytesIO(levels), [page], "UNCOMPRESSED", 1, 5000, 5000)
    assert runs == 5000 and counts.tolist() == [8] * 5000
    with pytest.raises(TooManyRuns):
        row_values(io.BytesIO(levels), [page], "UNCOMPRESSED", 1, 5000, 4999)
    assert max_runs(LIMITS) == 2 * 51_025 + 204_800
