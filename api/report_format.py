"""``freight report`` output: the usage report's rows as an aligned table, CSV, JSON or Parquet."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields

from api.formatting import count, money, number, percent
from api.services.adapter_usage import AdapterRow
from api.services.reports import ALL, ReportRow

FORMATS = ("table", "csv", "json", "parquet")
TEXT_FORMATS = ("table", "csv", "json")
FIELDS = tuple(f.name for f in fields(ReportRow))
# a spreadsheet opening the CSV runs a cell that starts with one of these as a formula (CSV
# injection through a tenant or model name): such text cells get a leading apostrophe, which
# spreadsheets show as text. Numbers are never text cells, so a negative saving stays a number
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


# (header, cell, right-aligned)
_COLUMNS: tuple[tuple[str, Callable[[ReportRow], str], bool], ...] = (
    ("tenant", lambda r: r.tenant, False),
    ("model", lambda r: r.model, False),
    ("batches", lambda r: count(r.batches), True),
    ("completed", lambda r: count(r.requests_completed), True),
    ("failed", lambda r: count(r.requests_failed), True),
    ("prompt tok", lambda r: count(r.prompt_tokens), True),
    ("cached tok", lambda r: count(r.cached_tokens), True),
    ("output tok", lambda r: count(r.output_tokens), True),
    ("engine s", lambda r: number(r.engine_seconds), True),
    ("cost", lambda r: money(r.cost), True),
    ("$/1M tok", lambda r: money(r.cost_per_1m_tokens), True),
    ("$/1M in", lambda r: money(r.cost_per_1m_input), True),
    ("$/1M cached", lambda r: money(r.cost_per_1m_cached_input), True),
    ("$/1M out", lambda r: money(r.cost_per_1m_output), True),
    ("list price", lambda r: money(r.list_price), True),
    ("saving", lambda r: percent(r.saving), True),
    ("cache hit", lambda r: percent(r.cache_hit_rate), True),
    ("plan hit", lambda r: percent(r.planned_cache_hit_rate), True),
    ("fill", lambda r: percent(r.mean_fill), True),
    ("MFU", lambda r: percent(r.mfu), True),
    ("MBU", lambda r: percent(r.mbu), True),
    ("out tok/s", lambda r: number(r.output_tok_s), True),
    ("SLA met", lambda r: f"{r.sla_met}/{r.sla_batches}", True),
    ("SLA %", lambda r: percent(r.sla_attainment), True),
    ("goodput b/h", lambda r: number(r.goodput_batches_per_hour, 2), True),
    ("goodput req/h", lambda r: number(r.goodput_requests_per_hour, 1), True),
)


def format_table(rows: Sequence[ReportRow]) -> str:
    """Aligned columns (text left, numbers right), a rule under the header and above the total."""
    cells = [[cell(r) for _, cell, _ in _COLUMNS] for r in rows]
    header = [name for name, _, _ in _COLUMNS]
    widths = [max(len(c) for c in column) for column in zip(header, *cells, strict=True)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w)
            for v, w, (_, _, right) in zip(values, widths, _COLUMNS, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(header), rule]
    for r, values in zip(rows, cells, strict=True):
        if r.tenant == ALL and r.model == ALL:
            out.append(rule)
        out.append(line(values))
    return "\n".join(out) + "\n"


def csv_cell(value: object) -> object:
    """None is an empty cell; text that a spreadsheet would take for a formula is escaped."""
    if value is None:
        return ""
    # a lone "-" (the report's "no model") is no formula and stays as it is
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and value != "-":
        return "'" + value
    return value


def format_csv(rows: Sequence[ReportRow]) -> str:
    """A header of ReportRow's field names, one line per row; None is an empty cell, and a text
    cell starting with = + - @ (or a tab or CR) starts with an apostrophe."""
    buffer = io.StringIO()
    # RFC 4180 line ends: the writer then quotes a cell holding a lone CR, which a "\n" terminator
    # would leave bare (a row broken in two by a name)
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, lineterminator="\r\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: csv_cell(v) for k, v in asdict(r).items()})
    return buffer.getvalue()


def format_json(rows: Sequence[ReportRow]) -> str:
    """A list of objects keyed by ReportRow's field names; None is null."""
    return json.dumps([asdict(r) for r in rows], indent=2) + "\n"


def format_report(rows: Sequence[ReportRow], fmt: str) -> str:
    formatters = {"table": format_table, "csv": format_csv, "json": format_json}
    if fmt not in formatters:
        raise ValueError(f"unknown text report format {fmt!r} (expected {', '.join(TEXT_FORMATS)})")
    return formatters[fmt](rows)


def format_adapter_report(rows: Sequence[AdapterRow], fmt: str) -> str:
    """``--by-adapter``'s rows: an aligned table, CSV (text cells escaped as above) or JSON."""
    if fmt == "json":
        return json.dumps([asdict(r) for r in rows], indent=2) + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(
            buffer, fieldnames=[f.name for f in fields(AdapterRow)], lineterminator="\r\n"
        )
        writer.writeheader()
        for r in rows:
            writer.writerow({k: csv_cell(v) for k, v in asdict(r).items()})
        return buffer.getvalue()
    header = ["tenant", "base", "adapter", "requests", "prompt tok", "cached tok", "output tok", "cost"]
    cells = [
        [r.tenant, r.base, r.adapter, count(r.requests), count(r.prompt_tokens), count(r.cached_tokens),
         count(r.output_tokens), money(r.cost)]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c) for c in column) for column in zip(header, *cells, strict=True)]
    out = [
        "  ".join(
            v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()
        for values in [header, ["-" * w for w in widths], *cells]
    ]
    return "\n".join(out) + "\n"


def _arrow_type(annotation: object) -> object:
    import pyarrow as pa

    kind = str(annotation).replace(" | None", "")
    return {"str": pa.string(), "int": pa.int64(), "float": pa.float64()}[kind]


def format_parquet(rows: Sequence[ReportRow]) -> bytes:
    """One typed column per ReportRow field (strings, int64, float64; None is null)."""
    import io as _io

    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(f.name, _arrow_type(f.type)) for f in fields(ReportRow)])
    table = pa.Table.from_pylist([asdict(r) for r in rows], schema=schema)
    sink = _io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()
