"""`freight report --format csv` cannot carry a formula into a spreadsheet (issue #19, section 9):
a text cell starting with = + - @ (or a tab or carriage return) is escaped with a leading
apostrophe; numbers, negative ones included, stay numbers."""

from __future__ import annotations

import csv
import io
from dataclasses import fields

import pytest

from api.report_format import format_csv
from api.services.reports import ReportRow


def row(tenant: str, model: str, **values: object) -> ReportRow:
    zero = {f.name: 0 for f in fields(ReportRow) if f.name not in ("tenant", "model")}
    return ReportRow(tenant=tenant, model=model, **{**zero, **values})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    ['=HYPERLINK("http://evil","x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\t=1", "\r=1"],
)
def test_text_a_spreadsheet_would_run_is_escaped(text: str) -> None:
    (parsed,) = csv.DictReader(io.StringIO(format_csv([row(text, text)]), newline=""))
    assert parsed["tenant"] == parsed["model"] == "'" + text


def test_plain_text_and_numbers_are_left_alone() -> None:
    rows = [row("alpha", "demo-1", saving=-0.25, cost=1.5, sla_attainment=None)]
    (parsed,) = csv.DictReader(io.StringIO(format_csv(rows), newline=""))
    assert (parsed["tenant"], parsed["model"]) == ("alpha", "demo-1")
    assert parsed["saving"] == "-0.25" and parsed["cost"] == "1.5" and parsed["sla_attainment"] == ""
