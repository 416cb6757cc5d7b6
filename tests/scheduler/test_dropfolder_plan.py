"""The drop-folder decisions, pure: new objects, sidecars, result and archive keys, backoff and the
manifest. No fixtures."""

from __future__ import annotations

import json

import pytest

from scheduler.dropfolder_plan import (
    BatchFacts,
    Delivery,
    InboxFile,
    Listed,
    Sidecar,
    SidecarError,
    backoff_seconds,
    build_manifest,
    file_request,
    fill_model,
    folder_url,
    full_key,
    inbox_name,
    manifest_bytes,
    moved_key,
    parse_folder_url,
    parse_sidecar,
    plan_scan,
    refusal,
    result_keys,
)


def listed(key: str, etag: str = "e1", modified: float = 100.0, size: int = 10) -> Listed:
    return Listed(key, size, etag, modified)


def test_folder_urls() -> None:
    assert parse_folder_url("s3://bucket/team/evals/") == ("bucket", "team/evals")
    assert parse_folder_url("s3://bucket") == ("bucket", "")
    assert folder_url("bucket", "team/evals") == "s3://bucket/team/evals"
    assert folder_url("bucket", "") == "s3://bucket"
    assert full_key("team/evals", "inbox/a.jsonl") == "team/evals/inbox/a.jsonl"
    assert full_key("", "inbox/a.jsonl") == "inbox/a.jsonl"
    for bad in ("file:///tmp/x", "s3:///prefix", "s3://b/a//c", "s3://b/a/../c", "http://b/c"):
        with pytest.raises(ValueError):
            parse_folder_url(bad)


def test_inbox_names() -> None:
    assert inbox_name("inbox/a.jsonl") == ("a", False)
    assert inbox_name("inbox/data.v2.jsonl.gz") == ("data.v2", True)
    for ignored in (
        "inbox/a.jsonl.freight.json",  # a sidecar
        "inbox/notes.txt",
        "inbox/sub/a.jsonl",  # sub-folders are not watched
        "inbox/.jsonl",
        "outbox/a.jsonl",
        "inbox/",
    ):
        assert inbox_name(ignored) is None, ignored


def test_plan_scan_takes_new_versions_oldest_first_with_their_sidecars() -> None:
    listing = [
        listed("inbox/b.jsonl", "eb", modified=200),
        listed("inbox/a.jsonl", "ea", modified=100),
        listed("inbox/a.jsonl.freight.json", "side", modified=50),
        listed("inbox/c.jsonl.gz", "ec", modified=150),
        listed("inbox/readme.txt", "x", modified=1),
        listed("archive/old.jsonl", "o", modified=1),
    ]
    plan = plan_scan(listing, known=set())
    assert [f.key for f in plan] == ["inbox/a.jsonl", "inbox/c.jsonl.gz", "inbox/b.jsonl"]
    assert plan[0] == InboxFile("inbox/a.jsonl", "a", "ea", 10, False, "inbox/a.jsonl.freight.json")
    assert plan[1].gzip and plan[1].name == "c" and plan[1].sidecar is None


def test_plan_scan_skips_known_versions_but_not_a_reupload_with_new_content() -> None:
    listing = [listed("inbox/a.jsonl", "v1"), listed("inbox/b.jsonl", "v2")]
    assert plan_scan(listing, known={("inbox/a.jsonl", "v1"), ("inbox/b.jsonl", "v1")}) == [
        InboxFile("inbox/b.jsonl", "b", "v2", 10, False, None)
    ]
    assert plan_scan(listing, known={("inbox/a.jsonl", "v1"), ("inbox/b.jsonl", "v2")}) == []


def test_result_and_archive_keys() -> None:
    keys = result_keys("data")
    assert (keys.output, keys.errors, keys.manifest) == (
        "outbox/data.output.jsonl",
        "outbox/data.errors.jsonl",
        "outbox/data.manifest.json",
    )
    assert moved_key("inbox/data.jsonl.gz", failed=False) == "archive/data.jsonl.gz"
    assert moved_key("inbox/data.jsonl", failed=True) == "failed/data.jsonl"
    assert moved_key("inbox/data.jsonl.freight.json", failed=True) == "failed/data.jsonl.freight.json"


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff_seconds(n, 5, 60) for n in range(7)] == [0, 5, 10, 20, 40, 60, 60]
    assert backoff_seconds(10_000, 5, 300) == 300  # no overflow


def test_sidecar_overrides_and_errors() -> None:
    side = parse_sidecar(b'{"model": "demo", "window": "1h", "metadata": {"project": "evals"}}')
    assert side == Sidecar("demo", "1h", (("project", "evals"),))
    assert parse_sidecar(b'\xef\xbb\xbf{"completion_window": "24h"}') == Sidecar(None, "24h", ())
    for bad, words in (
        (b"not json", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b'{"modle": "demo"}', r"unknown sidecar field\(s\) modle"),
        (b'{"model": 3}', "model"),
        (b'{"metadata": {"a": 1}}', "metadata"),
        (b'{"metadata": {"source_object": "s3://x/y"}}', "Freight sets them"),
        (b"{" + b" " * 70_000 + b"}", "larger than"),
    ):
        with pytest.raises(SidecarError, match=words):
            parse_sidecar(bad)


def test_file_request_sidecar_wins_and_metadata_names_the_source() -> None:
    plain = file_request("demo", "24h", None, "s3://b/p/inbox/a.jsonl", "etag1")
    assert plain.model == "demo" and plain.window == "24h"
    assert dict(plain.metadata) == {"source_object": "s3://b/p/inbox/a.jsonl", "source_etag": "etag1"}
    side = file_request("demo", "24h", Sidecar("other", "1h", (("k", "v"),)), "s3://b/a", "e")
    assert (side.model, side.window) == ("other", "1h")
    assert dict(side.metadata) == {"k": "v", "source_object": "s3://b/a", "source_etag": "e"}
    assert file_request(None, "24h", None, "s3://b/a", "e").model is None


def test_fill_model_only_where_a_line_has_none() -> None:
    line = json.dumps({"custom_id": "1", "body": {"messages": []}}).encode()
    assert json.loads(fill_model(line, "demo"))["body"]["model"] == "demo"
    own = json.dumps({"custom_id": "1", "body": {"model": "mine"}}).encode()
    assert fill_model(own, "demo") == own  # the line's own model wins
    for untouched in (b"not json", b"[1, 2]", b'{"body": "text"}', b"\xff\xfe"):
        assert fill_model(untouched, "demo") == untouched  # left for validation to report
    bom = b"\xef\xbb\xbf" + line
    assert json.loads(fill_model(bom, "demo", first=True))["body"]["model"] == "demo"


def facts(**kw: object) -> BatchFacts:
    base: dict[str, object] = dict(
        id="batch_1", status="completed", endpoint="/v1/chat/completions", model="demo",
        completion_window="24h", created_at=1000, expires_at=87400, finished_at=1060, sla_met=True,
        total=3, completed=2, failed=1, input_tokens=30, cached_tokens=10, output_tokens=12,
        cost={"currency": "usd", "total": 0.002},
    )  # fmt: skip
    base.update(kw)
    return BatchFacts(**base)  # type: ignore[arg-type]


def test_manifest_of_a_completed_batch() -> None:
    d = Delivery("bucket", "team", "inbox/data.jsonl", "e1", 123, facts())
    m = build_manifest(d)
    assert m["status"] == "completed" and m["batch_id"] == "batch_1"
    assert m["source"] == {
        "url": "s3://bucket/team/inbox/data.jsonl", "bucket": "bucket", "key": "team/inbox/data.jsonl",
        "etag": "e1", "bytes": 123,
    }  # fmt: skip
    assert m["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert m["usage"] == {"input_tokens": 30, "cached_tokens": 10, "output_tokens": 12, "total_tokens": 42}
    assert m["cost"] == {"currency": "usd", "total": 0.002}
    assert (m["deadline"], m["sla_met"], m["finished_at"]) == (87400, True, 1060)
    assert m["results"] == {
        "output": "s3://bucket/team/outbox/data.output.jsonl",
        "errors": "s3://bucket/team/outbox/data.errors.jsonl",
        "input": "s3://bucket/team/archive/data.jsonl",
    }
    assert m["errors"] == []
    assert json.loads(manifest_bytes(m)) == m


def test_manifest_of_a_file_that_failed_validation_or_was_refused() -> None:
    errors = ({"code": "invalid_json_line", "message": "line is not valid JSON", "param": None, "line": 2},)
    failed = Delivery("b", "", "inbox/bad.jsonl", "e", 5, facts(status="failed", sla_met=None, errors=errors))
    m = build_manifest(failed)
    assert m["status"] == "failed" and m["errors"] == [errors[0]]
    assert m["results"] == {"output": None, "errors": None, "input": "s3://b/failed/bad.jsonl"}

    refused = Delivery("b", "", "inbox/z.jsonl.gz", "e", 5, None, (refusal("invalid_gzip", "not gzip"),))
    m = build_manifest(refused)
    assert m["status"] == "failed" and m["batch_id"] is None and m["cost"] is None
    assert m["errors"] == [{"code": "invalid_gzip", "message": "not gzip", "param": None, "line": None}]
    assert m["results"]["input"] == "s3://b/failed/z.jsonl.gz"
    assert m["request_counts"] == {"total": 0, "completed": 0, "failed": 0}


def test_expired_and_cancelled_batches_deliver_their_partial_results_to_archive() -> None:
    for status in ("expired", "cancelled"):
        d = Delivery("b", "p", "inbox/x.jsonl", "e", 1, facts(status=status, sla_met=False))
        assert d.writes_results and d.archive == "archive/x.jsonl"
        assert build_manifest(d)["status"] == status
