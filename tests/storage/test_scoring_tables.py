"""Score and rerank batches as Parquet: the simple input shape's `query` / `queries` (or `text_1`,
`data_1`) column beside a documents column becomes /v1/rerank or /v1/score lines (the batch's
endpoint, or for a file not in a batch the one the columns imply), each a body vLLM's request
classes accept; their results as Parquet are a row per score (storage/score_tables.py), with its
index, rank and document, usage once a line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from storage.parquet_limits import DecodeLimits
from storage.request_tables import request_lines
from storage.result_tables import RESULT_SCHEMA, write_results
from storage.score_tables import score_schema
from workers.request_bodies import RERANK, SCORE, parse_body
from workers.results import encode, request_error_line, success_line

LIMITS = DecodeLimits(max_rows=10, max_line_bytes=1 << 16, max_total_bytes=1 << 20)


def test_simple_parquet_inputs_become_score_and_rerank_lines(tmp_path) -> None:
    rerank = pa.table(
        {"custom_id": ["r1", "r2"], "query": ["what is json?", "a fruit?"],
         "documents": [["a format", "a fruit"], ["an apple"]], "top_n": [1, None]}
    )  # fmt: skip
    score = pa.table({"custom_id": ["s1"], "text_1": ["q"], "text_2": [["d1", "d2"]]})
    for name, table in (("rerank", rerank), ("score", score)):
        pq.write_table(table, tmp_path / f"{name}.parquet")
    lines = [
        json.loads(line)
        for name in ("rerank", "score")
        for line in request_lines(str(tmp_path / f"{name}.parquet"), None, {"model": "rank"}, LIMITS)
    ]
    assert [(x["custom_id"], x["url"]) for x in lines] == [("r1", RERANK), ("r2", RERANK), ("s1", SCORE)]
    assert [x["body"] for x in lines] == [
        {"model": "rank", "query": "what is json?", "documents": ["a format", "a fruit"], "top_n": 1},
        {"model": "rank", "query": "a fruit?", "documents": ["an apple"]},
        {"model": "rank", "text_1": "q", "text_2": ["d1", "d2"]},
    ]
    for line in lines:  # each a valid body of its endpoint
        assert parse_body(line["url"], line["body"]).endpoint == line["url"]
    # in a batch, the batch's endpoint names them
    (line,) = request_lines(str(tmp_path / "score.parquet"), SCORE, {"model": "rank"}, LIMITS)
    assert json.loads(line)["url"] == SCORE


def _written(tmp_path, lines: list[dict]) -> list[dict]:
    target = str(tmp_path / "out.parquet")
    rows = write_results((encode(line) for line in lines), target)
    table = pq.read_table(target)
    assert table.schema == score_schema(RESULT_SCHEMA) and table.num_rows == rows
    return table.to_pylist()


def test_score_results_are_a_row_per_score(tmp_path) -> None:
    usage = {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0, "prompt_tokens_details": None}
    body = {"id": "score-1", "object": "list", "created": 1, "model": "rank", "usage": usage,
            "data": [{"index": 0, "object": "score", "score": 0.5}, {"index": 1, "object": "score", "score": 0.25}]}  # fmt: skip
    rows = _written(
        tmp_path, [success_line("s1", body), success_line("s2", {**body, "data": body["data"][:1]})]
    )
    assert [(r["custom_id"], r["score_index"], r["score"], r["rank"]) for r in rows] == [
        ("s1", 0, 0.5, None), ("s1", 1, 0.25, None), ("s2", 0, 0.5, None)
    ]  # fmt: skip
    # usage once a line: on its first row
    assert [r["prompt_tokens"] for r in rows] == [7, None, 7] and rows[0]["completion_tokens"] == 0
    bare = json.loads(rows[0]["response_body"])
    assert bare["data"] == [{"index": 0, "object": "score"}, {"index": 1, "object": "score"}]


def test_rerank_results_keep_each_documents_rank_and_text(tmp_path) -> None:
    body = {"id": "rerank-1", "model": "rank", "usage": {"prompt_tokens": 9, "total_tokens": 9},
            "results": [{"index": 1, "document": {"text": "high", "multi_modal": None}, "relevance_score": 0.9},
                        {"index": 0, "document": {"text": "low", "multi_modal": None}, "relevance_score": 0.1}]}  # fmt: skip
    error = request_error_line(
        "bad", 400, {"code": "unsupported_parameter", "message": "no", "param": "documents.0"}
    )
    rows = _written(tmp_path, [success_line("r1", body), error])
    assert [(r["custom_id"], r["rank"], r["score_index"], r["document"], r["score"]) for r in rows] == [
        ("r1", 0, 1, "high", 0.9), ("r1", 1, 0, "low", 0.1), ("bad", None, None, None, None)
    ]  # fmt: skip
    assert rows[2]["status_code"] == 400 and rows[2]["error_code"] == "unsupported_parameter"
    assert json.loads(rows[0]["response_body"])["results"] == [{"index": 1}, {"index": 0}]


def test_other_outputs_keep_the_result_columns(tmp_path) -> None:
    chat = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]
    }
    target = str(tmp_path / "chat.parquet")
    assert write_results([encode(success_line("c", chat))], target) == 1
    assert pq.read_table(target).schema == RESULT_SCHEMA
