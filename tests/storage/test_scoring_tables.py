"""Score and rerank batches as Parquet: the simple input shape's `query` / `queries` (or `text_1`,
`data_1`) column beside a documents column becomes /v1/rerank or /v1/score lines (the batch's
endpoint, or for a file not in a batch the one the columns imply), each a body vLLM's request
classes accept; their results keep the result table's columns, the body whole in response_body."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from storage.parquet_limits import DecodeLimits
from storage.request_tables import request_lines
from storage.result_tables import RESULT_SCHEMA, write_results
from workers.request_bodies import RERANK, SCORE, parse_body
from workers.results import encode, success_line

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


def test_score_results_keep_the_result_columns(tmp_path) -> None:
    body = {"id": "score-1", "object": "list", "created": 1, "model": "rank",
            "data": [{"index": 0, "object": "score", "score": 0.5}],
            "usage": {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0, "prompt_tokens_details": None}}  # fmt: skip
    target = str(tmp_path / "out.parquet")
    assert write_results([encode(success_line("s1", body))], target) == 1
    table = pq.read_table(target)
    assert table.schema == RESULT_SCHEMA
    (row,) = table.to_pylist()
    assert (row["custom_id"], row["status_code"], row["prompt_tokens"]) == ("s1", 200, 7)
    assert json.loads(row["response_body"])["data"][0]["score"] == 0.5
