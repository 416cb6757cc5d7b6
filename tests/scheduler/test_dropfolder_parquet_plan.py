"""Drop folders and Parquet (pure): .parquet inbox files are picked up, results named per format."""

from __future__ import annotations

from scheduler.dropfolder_plan import Delivery, Listed, inbox_name, is_parquet_key, plan_scan, result_keys


def test_parquet_inbox_files_are_request_files():
    assert inbox_name("inbox/rows.parquet") == ("rows", False)
    assert is_parquet_key("inbox/rows.parquet") and not is_parquet_key("inbox/rows.jsonl")
    (f,) = plan_scan(
        [Listed("inbox/rows.parquet", 10, "e1", 1.0), Listed("inbox/x/y.parquet", 1, "e", 1)], set()
    )
    assert (f.name, f.gzip) == ("rows", False)


def test_results_are_named_for_the_folders_output_format():
    assert result_keys("rows", "parquet").output == "outbox/rows.output.parquet"
    assert result_keys("rows").errors == "outbox/rows.errors.jsonl"
    d = Delivery("b", "p", "inbox/rows.parquet", "e", 1, None, output_format="parquet")
    assert (
        d.results.errors == "outbox/rows.errors.parquet" and d.results.manifest == "outbox/rows.manifest.json"
    )
