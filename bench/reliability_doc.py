"""docs/reliability.md's figures, written from ``bench/results/reliability.json`` alone.

Between two marker comments of the chapter: the scenario table (one row per scenario of
``bench/reliability_scenarios.SCENARIOS`` in that order, then any scenario of the file the
generator does not know; a scenario with no record says so instead of showing older figures), the
line naming the run the figures are from (the file's provenance) and the date of every record that
run did not make (a partial run keeps the file's other records), and the hostile-tenant paragraphs
from the file's ``hostile`` section. The chapter's prose outside the markers holds no figure.

``python -m bench.reliability`` rewrites the chapter after it writes the file (whole or partial);
``python -m bench.reliability_doc --write`` does it from the committed file; without ``--write``
it prints the part; ``tests/bench/test_reliability_doc.py`` fails if the chapter differs from it.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.reliability_scenarios import SCENARIOS, Record, Scenario, seconds_range

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "bench" / "results" / "reliability.json"
DOC = REPO / "docs" / "reliability.md"
BEGIN = "<!-- reliability figures: written by `python -m bench.reliability_doc --write` from bench/results/reliability.json -->"
END = "<!-- end of the reliability figures -->"
NO_RECORD = "no record in bench/results/reliability.json"
NONE = "\N{EN DASH}"  # a cell with nothing recorded
COUNTS = ("lost", "duplicated", "server_errors")


class Absent:
    """A figure the record lacks: shown as such in any format spec, never as a number."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __format__(self, spec: str) -> str:
        return f"[`{self.key}` not recorded]"


class _Figures(dict[str, Any]):
    def __missing__(self, key: str) -> Absent:
        return Absent(key)


class _Formatter(string.Formatter):
    """``str.format_map`` that looks a field up by its whole name, so that an absent figure is
    an :class:`Absent` rather than a KeyError, and never reads attributes or items."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return kwargs[field_name], field_name


def fill(template: str, record: Record) -> str:
    return _Formatter().vformat(template, (), _Figures(record))


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell: no pipe, no line break, no raw HTML."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def _date(epoch: Any) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(epoch)) if isinstance(epoch, int | float) else "?"


def _generic(name: str, record: Record) -> str:
    """The figures of a scenario no template knows, as ``key value`` pairs."""
    skip = {"scenario", "recorded_at", *COUNTS}
    return "; ".join(
        f"{k} {v}" for k, v in sorted(record.items()) if k not in skip and not isinstance(v, dict | list)
    )


def scenario_row(scenario: Scenario, record: Record | None) -> str:
    if record is None:
        cells = [scenario.title, scenario.what, NONE, NONE, NONE, NO_RECORD, NONE]
    else:
        figures = {**record, **(scenario.derive(record) if scenario.derive else {})}
        counts = [str(record[k]) if k in record else format(Absent(k)) for k in COUNTS]
        cells = [
            scenario.title,
            scenario.what,
            *counts,
            fill(scenario.measured, figures),
            _date(record.get("recorded_at")),
        ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def table(scenarios: Mapping[str, Record]) -> str:
    rows = [
        "| scenario | what happens | lost | dup. | 5xx | measured | recorded |",
        "|---|---|---|---|---|---|---|",
    ]
    known = {s.name for s in SCENARIOS}
    for scenario in SCENARIOS:
        rows.append(scenario_row(scenario, scenarios.get(scenario.name)))
    for name in sorted(set(scenarios) - known):
        unknown = Scenario(
            name,
            f"`{name}`",
            "not described in bench/reliability_scenarios.py",
            _generic(name, scenarios[name]),
        )
        rows.append(scenario_row(unknown, scenarios[name]))
    return "\n".join(rows)


def _instant(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    for pattern in ("%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(text.replace("+00:00", "+0000"), pattern)
        except ValueError:
            continue
    return None


def _code_text(prov: Mapping[str, Any]) -> str:
    code = prov.get("code") or {}
    revision = str(code.get("revision") or "an unrecorded revision")[:7]
    if code.get("dirty_measured"):
        return f"{revision} with uncommitted changes to {', '.join(code['dirty_measured'])}"
    if code.get("dirty"):
        return f"{revision} (uncommitted changes only outside what it measures)"
    return revision


def _machine_text(prov: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    facts = prov.get("machine") or data.get("machine") or {}
    return f"{facts.get('cpu_model') or 'an unrecorded CPU'}, {facts.get('cores', '?')} cores"


def provenance_line(data: Mapping[str, Any]) -> str:
    """Which run wrote the file, and which records are older than it (a partial run keeps them)."""
    prov = data.get("provenance") or {}
    started, finished = (
        _instant(prov.get("started_at")),
        _instant(prov.get("finished_at") or data.get("generated_at")),
    )
    command = prov.get("command") or "a run that recorded no command"
    window = "at an unrecorded time"
    if started and finished:
        window = f"from {started:%Y-%m-%d %H:%M} to {finished:%H:%M} UTC"
    elif finished:
        window = f"finished {finished:%Y-%m-%d %H:%M} UTC"
    pytest = data.get("pytest") or {}
    line = (
        f"The figures are the records of `bench/results/reliability.json`, last written by `{command}` "
        f"at {_code_text(prov)}, {window}, on {_machine_text(prov, data)} (pytest: {pytest.get('summary', 'no summary')})."
    )
    older: dict[str, list[str]] = {}
    for name, record in sorted(data.get("scenarios", {}).items(), key=lambda kv: kv[1].get("recorded_at", 0)):
        at = record.get("recorded_at")
        inside = (
            started
            and finished
            and isinstance(at, int | float)
            and started.timestamp() - 1 <= at <= finished.timestamp() + 1
        )
        if not inside:
            older.setdefault(_date(at), []).append(f"`{name}`")
    if older:
        dates = "; ".join(f"{day}: {', '.join(names)}" for day, names in older.items())
        line += f" Records that run did not make, kept from earlier runs, by date: {dates}."
    return line


HOSTILE_ATTACKS = (
    "**Hostile tenants** (issues #19 and #49; `tests/e2e/test_hostile_tenants.py`, the file's top-level "
    "`hostile` section). Tenant A attacks while tenants B and C run batches of JSONL and Parquet: Parquet "
    "dictionary and page bombs, fetched as JSONL and validated; huge integers and deep nesting in lines, "
    "Parquet cells and drop-folder sidecars; urgent batches of a hopeless window; the quotas and an output "
    "past the stored-bytes limit; an expired file; `/metrics` with no token, a tenant's key, a forged "
    "`X-Forwarded-For` and `Bearer CHANGE-ME`, and `freight api` on placeholder secrets; another tenant's "
    "prompt probed through the prefix cache; lines of `n=128`; a big logprob output downloaded as Parquet; "
    "webhooks to special-purpose addresses and receivers that hang past the delivery limit; a revoked key, "
    "a disabled tenant, a replayed signed-out cookie, a big console upload without a session, sign-in and "
    "dry-run floods; hostile tenant names, CSV cells and `freight download ../../etc/cron.d/x`; checkpoint "
    "keys and a formula CSV row, which no tenant can bring in over the API, checked in-process. Every attack, "
    "when it came (seconds after B and C submitted) and what it got is in the list below."
)
HOSTILE_FIGURES = (
    "{attack_count} attacks recorded, {attacks_while_victims_ran} of them while B and C ran (done "
    "{victims_done_at_s} s after they submitted; their {victim_requests} requests in "
    "{victim_batches_completed} of {victim_batches} batches completed). Lost {lost}, duplicated "
    "{duplicated}, and {server_errors} 5xx among {responses} answers (B's and C's requests and the DNS "
    "run's webhook events together). Refusing the bombs, the API (gunicorn, all its processes) grew "
    "{api_bomb_growth_mb} MB over its {api_baseline_rss_mb} MB baseline, one API process "
    "{api_bomb_one_process_growth_mb} MB, one control process {control_bomb_one_process_growth_mb} MB "
    "(bound {rss_bound_mb} MB each), and the control worker's processes together "
    "{control_bomb_growth_mb} MB over {control_baseline_rss_mb} MB (bound {control_sum_bound_mb} MB: "
    "its pool validates B's and C's batches at the same time, so the sum holds that work too). Converting "
    "a {conversion_output_bytes:,}-byte output to Parquet grew the API {api_conversion_growth_mb} MB "
    "over its idle size (bound {rss_bound_mb} MB)."
)
HOSTILE_DNS = (
    "The tenant whose DNS hangs is in the section too, as the `hostile_dns` scenario of its own test "
    "(`tests/workers/test_webhook_dns.py`: the real webhook role in a mount namespace whose resolv.conf "
    "names a DNS server on loopback that never answers the attacker's host names; the stack's shared "
    "webhook worker cannot be given that resolver). Its attack joins the list (with no time: it is not "
    "timed from the victims' batches), its figures are the section's `dns_*`, and its counts are added "
    "to the section's. A lookup hung {dns_resolver_timeout_s} s against {dns_attempt_seconds} s an "
    "attempt; {dns_hung_lookups} of the attacker's names were ever looked up "
    "(`FREIGHT_WEBHOOK_TENANT_CONCURRENCY` {dns_tenant_concurrency}), its {dns_attacker_deliveries} "
    "deliveries stayed pending ({dns_attacker_attempts} attempts cut off), and the victim's "
    "{dns_victim_deliveries} deliveries arrived ({dns_lost} lost, {dns_duplicated} duplicated) in "
    "{dns_during_range} s during the attack against {dns_alone_range} s with no attacker."
)


def _answer(attack: Mapping[str, Any]) -> str:
    code = attack.get("error_code")
    return f"{attack.get('status')}" + (f" `{code}`" if code else "")


def hostile_part(section: Mapping[str, Any] | None) -> str:
    """The hostile-tenant paragraphs and the list of attacks, from the file's ``hostile`` section."""
    if section is None:
        return f"{HOSTILE_ATTACKS}\n\nThe file has no `hostile` section: {NO_RECORD}."
    figures = dict(section)
    attacks = section.get("attacks") or []
    figures["attack_count"] = len(attacks)
    for field, name in (
        ("dns_victim_delivery_during_attack_s", "dns_during_range"),
        ("dns_victim_delivery_alone_s", "dns_alone_range"),
    ):
        if section.get(field):
            figures[name] = seconds_range(section[field])
    rows = ["| at (s) | attack | answer | what it got |", "|---|---|---|---|"]
    for attack in attacks:
        at = attack.get("at_s")
        cells = [
            NONE if at is None else f"{at}",
            attack.get("attack", ""),
            _answer(attack),
            attack.get("detail", ""),
        ]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    paragraphs = [HOSTILE_ATTACKS + " " + fill(HOSTILE_FIGURES, figures)]
    if any(k.startswith("dns_") for k in section):
        paragraphs.append(fill(HOSTILE_DNS, figures))
    return "\n\n".join([*paragraphs, "\n".join(rows)])


def render(data: Mapping[str, Any]) -> str:
    """The chapter's generated part (between the markers) from a reliability.json's content."""
    return "\n\n".join(
        [table(data.get("scenarios", {})), provenance_line(data), hostile_part(data.get("hostile"))]
    )


def generated_part(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def write(result: Path = RESULT, doc: Path = DOC) -> str:
    """Rewrite ``doc``'s generated part from ``result``; returns the part."""
    part = render(json.loads(result.read_text()))
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:start] + "\n" + part + "\n" + text[end:])
    return part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the figures into docs/reliability.md")
    parser.add_argument(
        "--result", type=Path, default=RESULT, help="print from this reliability.json instead"
    )
    args = parser.parse_args(argv)
    if args.write and args.result != RESULT:
        parser.error("--write takes the committed file's figures only (a trial run's stay out of the docs)")
    if not args.write:
        print(render(json.loads(args.result.read_text())))
        return 0
    write()
    print(f"{DOC.relative_to(REPO)}: the figures of {RESULT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
