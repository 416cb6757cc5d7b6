"""Parquet in and out: JSONL <-> Parquet round trips keep every custom_id and value, and a reader
outside Freight (DuckDB) reads what Freight writes."""

from __future__ import annotations

import base64
import io
import json

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from storage.request_tables import RowError, metadata_defaults, request_lines, write_requests
from storage.result_tables import write_results
from workers.results import encode, request_error_line, stopped_line, success_line

CHAT = "/v1/chat/completions"


def requests(n: int = 50) -> list[dict]:
    return [
        {
            "custom_id": f"id-{i}-é✓",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": "demo",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"q{i} 🚀"},
                ],
                "max_tokens": i % 9 + 1,
                "temperature": i / 10,
                "stop": ["\n\n"],
                "response_format": {"type": "json_object"},
                "seed": i,
            },
        }
        for i in range(n)
    ]


def test_jsonl_to_parquet_to_jsonl_keeps_every_custom_id_and_value(tmp_path):
    original = requests()
    target = tmp_path / "requests.parquet"
    rows = write_requests((json.dumps(x, ensure_ascii=False).encode() for x in original), str(target))
    assert rows == len(original)
    back = [json.loads(line) for line in request_lines(str(target), CHAT)]
    assert back == original
    con = duckdb.connect()
    got = con.execute(
        f"select custom_id, json_extract(body, '$.seed')::int from '{target}' order by 2"
    ).fetchall()
    assert got == [(x["custom_id"], x["body"]["seed"]) for x in original]


def test_simple_shape_with_defaults_from_the_file_and_the_batch(tmp_path):
    table = pa.table(
        {
            "custom_id": ["a", "b", "c"],
            "messages": [
                [{"role": "user", "content": "hi"}],
                [{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}],
                [{"role": "user", "content": "x"}],
            ],
            "temperature": [0.5, None, 1.0],
        }
    ).replace_schema_metadata({"freight.defaults": json.dumps({"model": "demo", "max_tokens": 8})})
    path = tmp_path / "simple.parquet"
    pq.write_table(table, path)
    lines = [
        json.loads(x) for x in request_lines(str(path), CHAT, metadata_defaults({"default_max_tokens": "3"}))
    ]
    assert [x["custom_id"] for x in lines] == ["a", "b", "c"]
    assert lines[0] == {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": "demo",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5,
        },
    }
    assert "temperature" not in lines[1]["body"]  # null cells are left out


def test_bad_rows_name_their_row_and_column(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"custom_id": ["a", "b"], "body": ['{"model": "demo"}', "{not json"]}), path)
    out = list(request_lines(str(path), CHAT))
    assert isinstance(out[0], bytes)
    assert out[1] == RowError(2, "invalid_body", out[1].message, "body")
    assert out[1].message.startswith("row 2, column 'body'")
    pq.write_table(pa.table({"custom_id": ["a"], "question": ["?"]}), path)
    (only,) = request_lines(str(path), CHAT)
    assert isinstance(only, RowError) and only.code == "invalid_parquet_columns"


def test_results_as_typed_parquet_read_by_duckdb(tmp_path):
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Paris ✓"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 3,
            "total_tokens": 15,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
    lines = [
        success_line("ok-1", body),
        request_error_line(
            "bad-1", 400, {"code": "context_length_exceeded", "message": "too long", "param": "messages"}
        ),
        stopped_line("late-1", "batch_expired"),
    ]
    target = tmp_path / "results.parquet"
    assert write_results((encode(x) for x in lines), str(target)) == 3
    con = duckdb.connect()
    rows = con.execute(
        "select custom_id, status_code, content, finish_reason, prompt_tokens, cached_tokens, completion_tokens,"
        f" error_code, error_message, response_body from '{target}'"
    ).fetchall()
    assert rows[0][:9] == ("ok-1", 200, "Paris ✓", "stop", 12, 8, 3, None, None)
    assert json.loads(rows[0][9]) == body
    assert rows[1][:2] == ("bad-1", 400) and rows[1][7:9] == ("context_length_exceeded", "too long")
    assert rows[2][:3] == ("late-1", None, None) and rows[2][7] == "batch_expired"
    types = dict(
        con.execute(f"select column_name, column_type from (describe select * from '{target}')").fetchall()
    )
    assert (types["status_code"], types["prompt_tokens"], types["content"]) == (
        "INTEGER",
        "BIGINT",
        "VARCHAR",
    )


def test_a_response_objects_text_status_and_usage_fill_the_typed_columns(tmp_path):
    message = {"type": "message", "id": "msg_1", "status": "incomplete", "role": "assistant"}
    body = {
        "id": "resp_1",
        "object": "response",
        "status": "incomplete",
        "output": [
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
            },
            {**message, "content": [{"type": "output_text", "text": "Par", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"},
        ],
        "usage": {
            "input_tokens": 12,
            "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
            "output_tokens": 3,
            "output_tokens_details": {"reasoning_tokens": 1},
            "total_tokens": 15,
        },
    }
    target = tmp_path / "responses.parquet"
    assert write_results([encode(success_line("resp-parquet-1", body))], str(target)) == 1
    row = (
        duckdb.connect()
        .execute(
            "select custom_id, status_code, content, text, finish_reason, prompt_tokens, cached_tokens,"
            f" completion_tokens, error_code, response_body from '{target}'"
        )
        .fetchone()
    )
    assert row[:9] == ("resp-parquet-1", 200, "Par", None, "incomplete", 12, 8, 3, None)
    assert json.loads(row[9]) == body


def test_a_chat_files_image_columns_become_image_parts_of_the_last_user_message() -> None:
    from tests.factories import image_bytes

    png, jpeg = image_bytes(8, 8), image_bytes(8, 8, fmt="JPEG")
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = pa.table(
        {
            "custom_id": ["one", "two", "link", "none", "alone"],
            "messages": pa.array(
                [
                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe it."}],
                    [{"role": "user", "content": "Compare them."}],
                    [{"role": "user", "content": "And this?"}],
                    [{"role": "user", "content": "No image."}],
                    [{"role": "system", "content": "No user."}],
                ],
                messages,
            ),
            "images": pa.array([[png], [png, jpeg], None, None, [png]], pa.list_(pa.binary())),
            "image": pa.array([None, None, "https://example.com/a.png", None, None], pa.string()),
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    lines = list(request_lines(io.BytesIO(out.getvalue()), "/v1/chat/completions"))
    bodies = [json.loads(line)["body"] for line in lines[:4]]

    def urls(body: dict) -> list[str]:
        return [p["image_url"]["url"] for p in body["messages"][-1]["content"] if p["type"] == "image_url"]

    assert urls(bodies[0])[0].startswith("data:image/png;base64,")
    assert base64.b64decode(urls(bodies[0])[0].split(",", 1)[1]) == png
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert bodies[0]["messages"][1]["content"][-1] == {"type": "text", "text": "Describe it."}
    assert [u.split(";")[0] for u in urls(bodies[1])] == ["data:image/png", "data:image/jpeg"]
    assert urls(bodies[2]) == ["https://example.com/a.png"]  # a string is a URL as it is
    assert bodies[3]["messages"] == [{"role": "user", "content": "No image."}]
    error = lines[4]
    assert isinstance(error, RowError) and error.row == 5 and error.column == "image"
    assert "needs a messages column with a user message" in error.message


def _parquet(table: pa.Table, **kw) -> io.BytesIO:
    out = io.BytesIO()
    pq.write_table(table, out, **kw)
    return io.BytesIO(out.getvalue())


def test_an_audio_files_audio_column_becomes_the_bodys_file_url() -> None:
    """The simple shape of a transcription or translation file: ``audio`` binary becomes a data URL
    of its type, a string (a file id, a data URL) is kept, the other columns are body fields with
    nulls left out; a cell of another type, or audio given in both ``audio`` and ``file_url``, is
    that row's error naming the column; the rows after it still become lines."""
    from tests.audio_factories import TRANSCRIPTIONS, TRANSLATIONS, tone

    wav, flac = tone(0.2), tone(0.2, fmt="FLAC")
    table = pa.table(
        {
            "custom_id": ["wav", "flac", "by-id", "bytes", "twice"],
            "audio": pa.array([wav, flac, None, b"not audio", wav], pa.binary()),
            "file_url": [None, None, "file-abc123", None, "file-abc123"],
            "model": ["whisper"] * 5,
            "language": ["en", None, "fr", None, None],
            "prompt": [None, "Earlier.", None, None, None],
            "response_format": [None, "verbose_json", None, None, None],
            "temperature": [0.0, None, 0.2, None, None],
            "timestamp_granularities": pa.array([None, ["segment"], None, None, None], pa.list_(pa.string())),
        }
    )
    for endpoint in (TRANSCRIPTIONS, TRANSLATIONS):
        lines = list(request_lines(_parquet(table), endpoint))
        first = json.loads(lines[0])
        assert (first["url"], first["custom_id"]) == (endpoint, "wav")
        url = first["body"].pop("file_url")
        assert url.startswith("data:audio/wav;base64,") and base64.b64decode(url.split(",", 1)[1]) == wav
        assert first["body"] == {"model": "whisper", "language": "en", "temperature": 0.0}
        second = json.loads(lines[1])["body"]
        assert second["file_url"].startswith("data:audio/flac;base64,")
        assert (second["prompt"], second["response_format"]) == ("Earlier.", "verbose_json")
        assert second["timestamp_granularities"] == ["segment"]
        assert json.loads(lines[2])["body"]["file_url"] == "file-abc123"  # a string as it is
        assert json.loads(lines[3])["body"]["file_url"].startswith("data:application/octet-stream;base64,")
        twice = lines[4]
        assert isinstance(twice, RowError) and (twice.row, twice.column) == (5, "audio")
        assert "given twice" in twice.message
    # a data URL string is kept; a number is no audio
    numbers = pa.table({"custom_id": ["n", "after"], "audio": pa.array([7, None], pa.int64())})
    lines = list(request_lines(_parquet(numbers), TRANSCRIPTIONS))
    assert isinstance(lines[0], RowError) and (lines[0].row, lines[0].column) == (1, "audio")
    assert "audio is binary or a string" in lines[0].message
    assert json.loads(lines[1])["body"] == {}  # its own line: validation refuses it without file_url
    kept = pa.table({"custom_id": ["url"], "audio": ["data:audio/wav;base64,AAAA"]})
    assert json.loads(next(request_lines(_parquet(kept), TRANSCRIPTIONS)))["body"] == {
        "file_url": "data:audio/wav;base64,AAAA"
    }
    # a file downloaded as JSONL before it is in a batch: an audio file reads as transcriptions
    assert json.loads(next(request_lines(_parquet(kept), None)))["url"] == TRANSCRIPTIONS
    # a chat file's audio column is a body field as before (the chat request's own check says no)
    chat = pa.table({"custom_id": ["c"], "messages": ['[{"role":"user","content":"hi"}]'], "audio": ["x"]})
    assert json.loads(next(request_lines(_parquet(chat), CHAT)))["body"]["audio"] == "x"


def test_a_body_column_holding_transcription_bodies_is_read_as_any_endpoints() -> None:
    """The OpenAI batch columns need nothing of the endpoint: a ``body`` of a transcription (JSON
    text, its audio a data URL) is the line, with the batch's URL where ``url`` is null."""
    from tests.audio_factories import TRANSCRIPTIONS, audio_url, tone

    body = {"model": "whisper", "file_url": audio_url(tone(0.2)), "language": "en"}
    table = pa.table({"custom_id": ["a"], "body": [json.dumps(body)]})
    line = json.loads(next(request_lines(_parquet(table), TRANSCRIPTIONS)))
    assert line == {"custom_id": "a", "method": "POST", "url": TRANSCRIPTIONS, "body": body}


def test_transcription_results_fill_the_text_column(tmp_path) -> None:
    """A transcription's or translation's body has its text at the top (no choices): it is the
    row's ``text``; usage by duration is not a token count (prompt and completion tokens null)."""
    body = {"text": "hello there", "usage": {"type": "duration", "seconds": 3}}
    lines = [
        encode(success_line("a", body)),
        encode(success_line("b", {"text": "bonjour"})),
        encode(request_error_line("c", 400, {"code": "invalid_audio", "message": "not decodable"})),
    ]
    target = tmp_path / "out.parquet"
    write_results(lines, str(target))
    rows = pq.read_table(target).to_pylist()
    assert [(r["custom_id"], r["text"], r["error_code"]) for r in rows] == [
        ("a", "hello there", None),
        ("b", "bonjour", None),
        ("c", None, "invalid_audio"),
    ]
    assert rows[0]["prompt_tokens"] is None and json.loads(rows[0]["response_body"]) == body


READ_AND_MEASURE = """
import sys
import pyarrow as pa
from storage.parquet_limits import DecodeLimits
from storage.request_tables import RowError, request_lines
lines = request_lines(sys.argv[1], "/v1/audio/transcriptions", None, DecodeLimits(1000, 8 << 20, 200 << 20))
print(sum(not isinstance(line, RowError) for line in lines), pa.default_memory_pool().max_memory() / 2**20)
"""


def test_big_binary_cells_are_read_a_row_group_at_a_time(tmp_path) -> None:
    """A 64 MB file of 32 incompressible 2 MB audio cells in row groups of two: reading it as
    validation does (a local file, within the limits) holds Arrow buffers for about a row group,
    whatever the file's size (24 MB, the same for 96 MB). Read into buffers instead of mapped, the
    column chunks accumulated in Arrow's pool: 88 MB for this file, 120 MB for 96 MB."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    rng = np.random.default_rng(0)
    cells = [rng.integers(0, 256, 2 * 1024 * 1024, dtype=np.uint8).tobytes() for _ in range(32)]
    path = tmp_path / "audio.parquet"
    table = pa.table({"custom_id": [f"r{i}" for i in range(32)], "audio": pa.array(cells, pa.binary())})
    pq.write_table(table, path, row_group_size=2)
    del cells, table
    script = subprocess.run(
        [sys.executable, "-c", READ_AND_MEASURE, str(path)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows, pool_mb = script.stdout.split()
    assert int(rows) == 32
    assert float(pool_mb) < 40, f"reading grew Arrow's pool to {pool_mb} MB"


def test_chat_messages_in_row_groups_that_a_record_batch_would_cross_are_all_read(tmp_path) -> None:
    """Strings are read as dictionaries, one set per row group: a record batch across two row
    groups of a nested ``messages`` column made pyarrow refuse the file ("Nested data conversions
    not implemented for chunked array outputs"; bench/parquet.py's million rows in row groups of
    50,000 stopped at row 49,664). Row groups of 500 rows against batches of 512: every row comes
    back once, in order, with and without the decode limits, and a chunk of row groups too."""
    from storage.parquet_limits import DecodeLimits
    from storage.request_tables import ParquetChunk

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [("custom_id", pa.string()), ("messages", pa.list_(message)), ("max_tokens", pa.int32())]
    )
    rows = [
        {
            "custom_id": f"r{i}",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"text {i} " * 20},
            ],
            "max_tokens": 4,
        }
        for i in range(1_300)
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=500)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    limits = DecodeLimits(max_rows=10_000, max_line_bytes=1 << 20, max_total_bytes=1 << 30)
    for lines in (
        request_lines(str(path), CHAT, {"model": "demo"}),
        request_lines(str(path), CHAT, {"model": "demo"}, limits),
    ):
        read = [json.loads(line) for line in lines]
        assert [r["custom_id"] for r in read] == [f"r{i}" for i in range(1_300)]
        assert read[-1]["body"]["messages"][1]["content"] == "text 1299 " * 20
    chunk = ParquetChunk(start=1, stop=3, first_row=500)
    read = [json.loads(line) for line in request_lines(str(path), CHAT, {"model": "demo"}, limits, chunk)]
    assert [r["custom_id"] for r in read] == [f"r{i}" for i in range(500, 1_300)]
