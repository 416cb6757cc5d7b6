"""A resume's two halves on the workers' side (issue #48 part 3): the skip filter of validation
(``FileRules.skip``: the settled lines are neither rows nor errors, a duplicate of one still is)
and what the earlier batch's files give a resume (``settled``, ``carried``), on the local store
and S3 (SeaweedFS) and both databases."""

from __future__ import annotations

import json
from dataclasses import replace

from api.services.tenants import create_tenant
from storage.models import Batch, StoredFile
from storage.runtime import Runtime
from tests.conftest import now
from tests.workers.test_validation import RULES, good, raw, scan
from workers.results import encode, request_error_line, stopped_line, success_line
from workers.resume import carried, chain_usage, digest, own_usage, settled
from workers.validation import ScanResult


def skipping(*ids: str):
    return replace(RULES, skip=frozenset(digest(i.encode()) for i in ids))


def test_settled_lines_are_neither_rows_nor_errors() -> None:
    lines = [raw(good(f"r{i}")) for i in range(6)]
    rows, summary = scan(lines, skipping("r1", "r4", "not-in-the-file"))
    assert [r.custom_id for r in rows] == ["r0", "r2", "r3", "r5"]
    assert summary.rows == 4 and summary.error_count == 0


def test_a_duplicate_of_a_settled_line_is_still_a_duplicate() -> None:
    lines = [raw(good("r0")), raw(good("r1")), raw(good("r1"))]
    _, summary = scan(lines, skipping("r1"))
    assert [(e.line, e.code) for e in summary.errors] == [(3, "duplicate_custom_id")]


def test_a_blank_line_before_a_settled_line_is_inside_the_file() -> None:
    _, summary = scan([raw(good("r0")), b"", raw(good("r1"))], skipping("r1"))
    assert [(e.line, e.code) for e in summary.errors] == [(2, "empty_line")]


def test_a_file_whose_lines_are_all_settled_has_nothing_to_resume() -> None:
    _, summary = scan([raw(good("r0")), raw(good("r1"))], skipping("r0", "r1"))
    assert isinstance(summary, ScanResult) and summary.rows == 0
    assert [e.code for e in summary.errors] == ["nothing_to_resume"]


def test_settled_and_carried_read_the_earlier_files(runtime: Runtime, store_kind: str) -> None:
    rt = runtime
    tenant, _ = create_tenant(rt.db, f"t{now()}", now())
    output = [encode(success_line(f"ok-{i}", {"n": i})) for i in range(3)]
    errors = [
        encode(request_error_line("bad-0", 400, {"message": "no"})),
        encode(request_error_line("eng-0", 500, {"message": "engine"})),
        encode(stopped_line("stop-0", "batch_cancelled")),
        encode(request_error_line("bad-1", 422, {"message": "no"})),
    ]
    rows = []
    for name, content in (("out", output), ("err", errors), ("in", [b"{}\n"])):
        key = f"files/{tenant.id}/{name}"
        rt.store.put_chunks(key, content)
        rows.append(StoredFile(id=f"file-{name}{now()}", tenant_id=tenant.id, purpose="batch",
                               filename=name, bytes=1, object_key=key, created_at=now()))  # fmt: skip
    out_file, err_file, in_file = rows
    earlier = Batch(id=f"batch_e{now()}", tenant_id=tenant.id, endpoint="/v1/chat/completions",
                    input_file_id=in_file.id, completion_window="24h", status="cancelled",
                    created_at=now(), expires_at=now() + 60, output_file_id=out_file.id,
                    error_file_id=err_file.id, request_completed=3, prompt_tokens=30,
                    completion_tokens=9, cost_micros=70, engine_seconds=1.25)  # fmt: skip
    with rt.db.write() as s:
        s.add_all(rows)
        s.flush()
        s.add(earlier)
    assert settled(rt, earlier.id) == {digest(i.encode()) for i in ("ok-0", "ok-1", "ok-2", "bad-0", "bad-1")}

    counts = {"output": 0, "errors": 0}
    assert b"".join(carried(rt, earlier.id, "output", counts)) == b"".join(output)
    kept = b"".join(carried(rt, earlier.id, "errors", counts))
    assert [json.loads(x)["custom_id"] for x in kept.splitlines()] == ["bad-0", "bad-1"]
    assert kept == errors[0] + errors[3]  # the lines as they were
    assert counts == {"output": 3, "errors": 2}

    fields = {"tenant_id": tenant.id, "endpoint": "/v1/chat/completions", "input_file_id": in_file.id,
              "completion_window": "24h", "status": "completed", "created_at": now(),
              "expires_at": now() + 60, "cached_tokens": 0}  # fmt: skip
    later = Batch(id=f"batch_l{now()}", resumed_from=earlier.id, request_completed=2, prompt_tokens=20,
                  completion_tokens=6, cost_micros=30, engine_seconds=0.5, **fields)  # fmt: skip
    with rt.db.read() as s:
        total = chain_usage(s, later)
        assert chain_usage(s, earlier) is None  # not a resume
    assert total == {"batches": 2, "request_completed": 5, "input_tokens": 50, "cached_tokens": 0,
                     "output_tokens": 15, "engine_seconds": 1.75, "cost_micros": 100,
                     "total_tokens": 65}  # fmt: skip
    later.chain_usage = total
    with rt.db.write() as s:
        s.add(later)
    third = Batch(id=f"batch_t{now()}", resumed_from=later.id, request_completed=1, prompt_tokens=10,
                  completion_tokens=3, cost_micros=5, engine_seconds=0.25, **fields)  # fmt: skip
    with rt.db.read() as s:  # a resume of a resume: the earlier chain's sum plus its own
        chained = chain_usage(s, third)
    assert chained is not None and chained["batches"] == 3 and chained["input_tokens"] == 60
    assert (
        chained["cost_micros"] == 105 and chained["total_tokens"] == 78 and chained["engine_seconds"] == 2.0
    )
    assert own_usage(third)["input_tokens"] == 10  # its own stay its own
