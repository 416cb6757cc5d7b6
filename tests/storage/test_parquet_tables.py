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
