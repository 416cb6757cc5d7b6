"""Score and rerank results as Parquet: a row per score.

`storage.result_tables.write_results` hands an output file here when its first line is a score
response (``{"object": "list", "data": [{"object": "score", ...}]}``) or a rerank response
(``{"results": [{"index", "document", "relevance_score"}, ...]}``), with its own result columns and
row builder (passed in, as for embeddings: this module does not import that one), and this adds:

* ``score``: the pair's score (float64, as the JSON number was), a score's ``score`` or a rerank
  result's ``relevance_score``;
* ``score_index``: the pair's index in the request (a score's ``data[i].index``, a rerank result's
  document ``index``);
* ``rank``: a rerank result's place, 0 for the most relevant (null for a score line);
* ``document``: a rerank result's document text (null for a score line).

Why a row per score rather than per line: a line may score up to 2,048 documents, and a table of
(line, document, score) is what a ranking job is read as (a join back to the documents, a top-k
per query). A line's usage (``prompt_tokens``, ``completion_tokens`` 0) and ``response_body``
(without its scores: they are in the typed columns) are on its first row and null on the others,
so a sum over a column counts each line once. An error line is one row without a score.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import IO, Any

import pyarrow as pa

from storage.parquet_records import write_records

Record = Callable[[dict[str, Any]], dict[str, Any]]  # one result line -> its result columns

SCORE_COLUMNS = (
    ("score_index", pa.int32()),
    ("score", pa.float64()),
    ("rank", pa.int32()),
    ("document", pa.string()),
)


def score_schema(base: pa.Schema) -> pa.Schema:
    """The result columns (``base``) and the four of scores."""
    schema = base
    for name, kind in SCORE_COLUMNS:
        schema = schema.append(pa.field(name, kind))
    return schema


def scores_body(line: dict[str, Any]) -> dict[str, Any] | None:
    """The line's response body if it is a score or rerank response, else None."""
    response = line.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    if not isinstance(body, dict):
        return None
    data, results = body.get("data"), body.get("results")
    if body.get("object") == "list" and isinstance(data, list) and data:
        return body if all(isinstance(d, dict) and d.get("object") == "score" for d in data) else None
    if isinstance(results, list) and results:
        return body if all(isinstance(r, dict) and "relevance_score" in r for r in results) else None
    return None


def score_records(line: dict[str, Any], result_record: Record) -> list[dict[str, Any]]:
    """One output or error line -> its rows of `score_schema`: one per score, or a single row
    without one (an error line)."""
    body = scores_body(line)
    empty = {"score_index": None, "score": None, "rank": None, "document": None}
    if body is None:
        return [{**result_record(line), **empty}]
    if "results" in body:  # rerank: the documents by relevance
        items = body["results"]
        scores = [
            {
                "score_index": r.get("index"),
                "score": r.get("relevance_score"),
                "rank": position,
                "document": (r.get("document") or {}).get("text"),
            }
            for position, r in enumerate(items)
        ]
        bare = {**body, "results": [{"index": r.get("index")} for r in items]}
    else:
        items = body["data"]
        scores = [
            {"score_index": d.get("index"), "score": d.get("score"), "rank": None, "document": None}
            for d in items
        ]
        bare = {**body, "data": [{k: v for k, v in d.items() if k != "score"} for d in items]}
    first = result_record({**line, "response": {**line["response"], "body": bare}})
    first["completion_tokens"] = 0  # a score writes no tokens
    rest = {
        **first,
        "prompt_tokens": None,
        "cached_tokens": None,
        "completion_tokens": None,
        "response_body": None,
    }
    return [{**(first if i == 0 else rest), **score} for i, score in enumerate(scores)]


def write_score_results(
    lines: Iterable[dict[str, Any]], sink: IO[bytes] | str, base: pa.Schema, result_record: Record
) -> int:
    """Decoded result lines -> Parquet at ``sink``; returns the rows written (one per score)."""
    rows = (row for line in lines for row in score_records(line, result_record))
    return write_records(rows, sink, score_schema(base))
