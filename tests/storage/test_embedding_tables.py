"""Embeddings results as Parquet (storage/embedding_tables.py), written by the real codec
(`write_results`, as a download or a drop folder's outbox does) and read back by pyarrow and DuckDB:
a row per vector, float32 values exactly as the JSONL had them, a fixed-size list when every vector
has the same width, base64 kept as its string, usage counted once per line."""

from __future__ import annotations

import json
from array import array

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from storage import embedding_tables
from storage.parquet_limits import DecodeLimits
from storage.request_tables import request_lines
from storage.result_tables import RESULT_SCHEMA, write_results
from tests.factories import decode_base64_embedding
from workers.embeddings import embeddings_body
from workers.request_bodies import EMBEDDINGS, parse_body
from workers.results import encode, request_error_line, success_line


def vector(*values: float) -> list[float]:
    """The values as the engine gives them: float32, widened to Python floats."""
    return array("f", values).tolist()


A = vector(0.1, -1.25, 2.0, 3.3)
B = vector(-0.7, 0.0, 1e-7, 42.5)
C = vector(0.25, 0.5, -0.125, 9.9)


def written(tmp_path, lines: list[dict]) -> tuple[int, pa.Table, str]:
    target = str(tmp_path / "out.parquet")
    rows = write_results((encode(line) for line in lines), target)
    return rows, pq.read_table(target), target


def test_equal_widths_make_a_fixed_size_float32_column_a_row_per_vector(tmp_path) -> None:
    several = embeddings_body([B, C], "float", "embed", prompt_tokens=7)
    b64 = embeddings_body([A], "base64", "embed", prompt_tokens=3)
    lines = [
        success_line("one", embeddings_body([A], "float", "embed", prompt_tokens=3)),
        success_line("several", several),
        success_line("b64", b64),
        request_error_line("bad", 400, {"code": "invalid_request", "message": "no", "param": "input"}),
    ]
    rows, table, target = written(tmp_path, lines)
    assert rows == 5 and table.num_rows == 5
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert table.schema.names == [*RESULT_SCHEMA.names, "embedding_index", "embedding", "embedding_base64"]
    got = table.to_pylist()
    assert [(r["custom_id"], r["status_code"], r["embedding_index"]) for r in got] == [
        ("one", 200, 0), ("several", 200, 0), ("several", 200, 1), ("b64", 200, 0), ("bad", 400, None)
    ]  # fmt: skip
    assert [r["embedding"] for r in got] == [A, B, C, None, None]  # float32 values, exactly
    assert got[3]["embedding_base64"] == b64["data"][0]["embedding"]
    assert decode_base64_embedding(got[3]["embedding_base64"]) == A
    # usage once per line: on its first row; an embedding writes no tokens
    assert [r["prompt_tokens"] for r in got] == [3, 7, None, 3, None]
    assert [r["completion_tokens"] for r in got] == [0, 0, None, 0, None]
    # the body without its vectors, which are in the typed columns
    assert json.loads(got[1]["response_body"]) == {
        **several, "data": [{"object": "embedding", "index": 0}, {"object": "embedding", "index": 1}]
    }  # fmt: skip
    assert got[2]["response_body"] is None
    assert (got[4]["error_code"], got[4]["error_message"]) == ("invalid_request", "no")

    # DuckDB reads Parquet's list (the fixed size lives in the Arrow schema pyarrow stored)
    con = duckdb.connect()
    kind = con.execute(f"select column_type from (describe select embedding from '{target}')").fetchone()
    assert kind == ("FLOAT[]",)
    assert con.execute(f"select sum(prompt_tokens), sum(completion_tokens) from '{target}'").fetchone() == (
        13,
        0,
    )
    second = con.execute(f"select embedding[2] from '{target}' where custom_id = 'one'").fetchone()
    assert second == (-1.25,)


def test_unequal_widths_make_a_variable_float32_list(tmp_path) -> None:
    lines = [
        success_line("full", embeddings_body([A], "float", "embed", prompt_tokens=3)),
        success_line("short", embeddings_body([A[:2]], "float", "embed", prompt_tokens=3)),
    ]
    rows, table, _ = written(tmp_path, lines)
    assert rows == 2 and table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.column("embedding").to_pylist() == [A, A[:2]]


def test_a_large_file_is_written_in_bounded_record_batches(tmp_path, monkeypatch) -> None:
    # a small batch budget, so that many record batches pass through the spill file
    monkeypatch.setattr(embedding_tables, "BATCH_VALUES", 64)
    lines = [
        success_line(f"doc-{i}", embeddings_body([vector(i, -i, i / 3, 1.0)], "float", "embed", 2))
        for i in range(500)
    ]
    rows, table, target = written(tmp_path, lines)
    assert rows == 500 and table.schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert table.column("embedding").to_pylist() == [line["response"]["body"]["data"][0]["embedding"]
                                                    for line in lines]  # fmt: skip
    assert pq.ParquetFile(target).metadata.num_row_groups > 1


def test_other_outputs_keep_the_result_columns(tmp_path) -> None:
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip
    rows, table, _ = written(tmp_path, [success_line("chat", chat)])
    assert rows == 1 and table.schema == RESULT_SCHEMA


def test_a_simple_parquet_input_with_an_input_column_is_embeddings_lines(tmp_path) -> None:
    """Parquet in: the simple shape's `input` column (texts, lists of texts, or token-id lists)
    becomes /v1/embeddings lines, the batch's endpoint or, for a file not in a batch, inferred."""
    texts = pa.table(
        {"custom_id": ["a", "b"], "input": [["first text"], ["one", "two"]], "dimensions": [64, None]}
    ).replace_schema_metadata({"freight.defaults": json.dumps({"model": "emb"})})
    ids = pa.table(
        {"custom_id": ["c"], "input": pa.array([[[1, 5, 9], [1, 7]]], pa.list_(pa.list_(pa.int32())))}
    )
    for name, table in (("texts", texts), ("ids", ids)):
        pq.write_table(table, tmp_path / f"{name}.parquet")
    limits = DecodeLimits(max_rows=10, max_line_bytes=1 << 16, max_total_bytes=1 << 20)
    lines = [
        json.loads(line)
        for name in ("texts", "ids")
        for line in request_lines(str(tmp_path / f"{name}.parquet"), None, {"model": "emb"}, limits)
    ]
    assert [(x["custom_id"], x["url"]) for x in lines] == [
        ("a", EMBEDDINGS),
        ("b", EMBEDDINGS),
        ("c", EMBEDDINGS),
    ]
    assert [x["body"] for x in lines] == [
        {"model": "emb", "input": ["first text"], "dimensions": 64},
        {"model": "emb", "input": ["one", "two"]},
        {"model": "emb", "input": [[1, 5, 9], [1, 7]]},
    ]
    for line in lines:  # each a valid embeddings body
        assert parse_body(EMBEDDINGS, line["body"]).endpoint == EMBEDDINGS
