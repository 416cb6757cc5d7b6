"""Inputs that used to raise out of validation (issue #19, section 2): a JSON integer of more
digits than Python converts (ValueError) and nesting deeper than the parsers recurse
(RecursionError), in a JSONL line, a Parquet `body` cell, Parquet `freight.defaults` metadata, a
batch's `default_*` metadata, a drop-folder line and a drop-folder sidecar. Each becomes that
line's (or file's) error with a clear message; the batch fails instead of staying `validating`,
and the next file of a drop folder still runs. Real SQLite/PostgreSQL, SeaweedFS and tokenizer."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from api.services.tenants import create_tenant
from scheduler.dropfolder_plan import SidecarError, fill_model, parse_sidecar
from storage.models import Batch
from storage.request_tables import metadata_defaults, request_lines
from tests.conftest import now
from tests.factories import chat_line, jsonl, validated_batch
from workers.validation import FileRules, check_line

HUGE_INT = "9" * 5000  # past Python's 4,300-digit limit on int <-> str
DEEP = "[" * 20_000 + "]" * 20_000  # past every JSON parser's recursion limit (~1,000 levels)
CHAT = "/v1/chat/completions"


def chat_text(custom_id: str, **body_text: str) -> bytes:
    """A chat line whose body gets raw JSON text for some fields (a huge number, deep nesting)."""
    body = json.dumps(chat_line(custom_id, "hi")["body"])[:-1]
    extra = "".join(f',"{name}":{value}' for name, value in body_text.items())
    return f'{{"custom_id":"{custom_id}","method":"POST","url":"{CHAT}","body":{body}{extra}}}}}'.encode()


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (chat_text("a", seed=HUGE_INT), "more than 4300 digits"),
        (chat_text("a", stop=DEEP), "nested too deeply"),
        (HUGE_INT.encode(), "more than 4300 digits"),
        (DEEP.encode(), "nested too deeply"),
    ],
)
def test_a_line_that_crashed_the_parser_is_that_lines_error(raw: bytes, words: str) -> None:
    rules = FileRules(CHAT, frozenset({"demo"}), max_requests=10, max_line_bytes=1 << 20)
    error = check_line(raw, 7, rules)
    assert (error.line, error.code) == (7, "invalid_json_line"), error  # type: ignore[union-attr]
    assert words in error.message  # type: ignore[union-attr]


def test_batches_with_such_lines_fail_with_line_errors_and_the_good_lines_do_not_hide_them(runtime) -> None:
    tenant, _ = create_tenant(runtime.db, "t", now())
    data = (
        jsonl([chat_line("ok", "fine")]) + chat_text("n", seed=HUGE_INT) + b"\n" + chat_text("d", stop=DEEP)
    )
    batch_id = validated_batch(runtime, tenant.id, data + b"\n")
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
    assert batch.status == "failed"
    assert [(e["line"], e["code"]) for e in batch.errors["data"]] == [
        (2, "invalid_json_line"),
        (3, "invalid_json_line"),
    ]


def parquet(table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(metadata) if metadata else table, sink)
    return sink.getvalue()


def test_parquet_body_cells_and_file_defaults_that_crashed_are_row_and_file_errors() -> None:
    body = json.dumps(chat_line("x", "hi")["body"])
    cells = [body, body[:-1] + f',"seed":{HUGE_INT}}}', DEEP, body]
    table = pa.table({"custom_id": ["a", "b", "c", "d"], "body": cells})
    rows = list(request_lines(io.BytesIO(parquet(table)), CHAT))
    assert [type(r).__name__ for r in rows] == ["bytes", "RowError", "RowError", "bytes"]
    assert [(r.row, r.code, r.column) for r in rows[1:3]] == [
        (2, "invalid_body", "body"),
        (3, "invalid_body", "body"),
    ]
    assert "4300 digits" in rows[1].message and "nested too deeply" in rows[2].message

    for raw in (DEEP, f'{{"max_tokens": {HUGE_INT}}}'):
        [error] = list(request_lines(io.BytesIO(parquet(table, {b"freight.defaults": raw.encode()})), CHAT))
        assert (error.row, error.code) == (1, "invalid_parquet")


def test_batch_metadata_defaults_that_crashed_are_kept_as_text() -> None:
    assert metadata_defaults({"default_stop": DEEP, "default_seed": HUGE_INT}) == {
        "stop": DEEP,
        "seed": HUGE_INT,
    }


def test_drop_folder_lines_and_sidecars_that_crashed_are_left_to_validation_or_refused() -> None:
    for raw in (chat_text("a", seed=HUGE_INT), DEEP.encode()):
        assert fill_model(raw, "demo") == raw  # left as it is: validation reports the line
    for raw in (DEEP.encode(), f'{{"metadata": {{"n": {HUGE_INT}}}}}'.encode()):
        with pytest.raises(SidecarError, match="not valid JSON"):
            parse_sidecar(raw)
