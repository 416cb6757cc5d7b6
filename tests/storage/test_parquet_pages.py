"""The page headers of a Parquet file, read without decompressing a page (issue #19, section 1):
what the reader will allocate for each page, checked against pyarrow's own footer totals, and a
header that is cut off or nested without end is the file's error, never a crash."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.parquet_pages import PageHeaderError, pages

MB = 1024 * 1024


def written(table: pa.Table, **options) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **options)
    return sink.getvalue()


def table(rows: int = 20_000) -> pa.Table:
    return pa.table(
        {
            "custom_id": [f"r{i}" for i in range(rows)],
            "prompt": ["x" * (i % 300) for i in range(rows)],
            "prompt_token_ids": [[1, 2, i] for i in range(rows)],
            "messages": [[{"role": "user", "content": f"hi {i % 7}"}] for i in range(rows)],
        }
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"compression": "zstd", "row_group_size": 3000, "data_page_size": 8000},
        {"use_dictionary": False, "data_page_version": "2.0", "compression": "gzip"},
        {"write_page_index": True, "write_statistics": True},
    ],
)
def test_every_page_is_found_with_the_sizes_the_footer_adds_up(options) -> None:
    data = written(table(), **options)
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    found = list(pages(io.BytesIO(data), meta))
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            chunk = meta.row_group(g).column(c)
            mine = [p for p in found if (p.row_group, p.column) == (g, chunk.path_in_schema)]
            assert mine, (g, chunk.path_in_schema)
            # the footer's totals add the headers to the pages: the same bytes of header either way
            headers = chunk.total_compressed_size - sum(p.compressed for p in mine)
            assert chunk.total_uncompressed_size - sum(p.uncompressed for p in mine) == headers > 0
            if not chunk.has_dictionary_page:  # data pages alone: their values are the chunk's
                assert sum(p.values for p in mine) == chunk.num_values


def test_one_huge_value_is_one_huge_page_and_nothing_is_decompressed() -> None:
    data = written(pa.table({"body": ["a" * (40 * MB)]}), compression="zstd", use_dictionary=False)
    assert len(data) < 64 * 1024
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    [page] = pages(io.BytesIO(data), meta)
    assert page.uncompressed > 40 * MB and page.values == 1


def test_a_cut_off_or_endlessly_nested_header_is_the_files_error() -> None:
    data = written(pa.table({"a": ["x", "y"]}))
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    start = meta.row_group(0).column(0).dictionary_page_offset
    with pytest.raises(PageHeaderError, match="cut off"):
        list(pages(io.BytesIO(data[: start + 3]), meta))
    # a header of structs in structs (field 5, a struct, over and over): bounded, not a RecursionError
    nested = data[:start] + b"\x15\x00\x15\x00\x15\x00" + b"\x1c" * 50_000
    with pytest.raises(PageHeaderError, match="nested too deeply"):
        list(pages(io.BytesIO(nested), meta))
