"""Every measured figure in the repository's Markdown comes from a committed result file (issue
#50): a reader can follow any number to the run, the code revision and the machine behind it.

What counts as a measured figure (``FIGURE``): a number with a fractional part followed by a unit
of time (CPU time too), a ratio, a share or a size (``8.14 s``, ``0.754x`` (or with the multiplication sign), ``0.35%``, ``10.7 ms``,
``2.3 CPU-s``, ``1.3 GiB``; the unit may follow on the next line),
either end of a range of them (``0.97-1.15x``, the dash an en dash too), and any number followed by a rate (``12,600
lines/s``, ``835 tok/s``). Whole-number durations and shares are mostly settings and bounds
(``30 s``, ``80%``) and are not checked; write a measured one with its decimals. Text in code
spans and fenced blocks is not prose (commands, sample output) and is not checked, nor is the
README's benchmark table, which tests/test_docs.py checks cell by cell.

A bold number with two decimals or more (``**0.9237**``, ``**Freight / the engine: 0.88**``) is a
headline figure, with or without a unit, and is checked too.

Its source: a result file the figure's section cites by path (``bench/results/NAME.json``; the
section runs from the figure's heading to the next heading of any level). A section quoting an
earlier run says which commit holds that run's file ("as committed in 5e7f0d9"); the section's
files as they were in that commit are sources of its bold figures too (a figure with a unit must be
in the file as it is now: an earlier run is quoted without units, or in words). Some number in that
file (a value, or a number inside one of its strings), rounded to the figure's decimals, is the
figure: as it stands, or converted (a share ``0.35%`` from ``0.0035``; ``ms`` from seconds;
``minutes`` from seconds). A figure that is the quotient, sum or difference of stored values is
not its own source: store it, or quote the stored values.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from bench.doc_figures import EN_DASH, TIMES, figures, headlines, prose, unmarked

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PAGES = sorted(
    p.relative_to(REPO).as_posix()
    for p in [REPO / "README.md", *REPO.glob("docs/*.md"), REPO / "bench" / "README.md"]
)
CITATION = re.compile(r"bench/results/([\w.-]+\.json)")
NAMED = re.compile(r"`([\w.-]+\.json)`")  # a result file named without its folder ("`lora.json`")
AS_COMMITTED = re.compile(r"as\s+committed\s+in\s+([0-9a-f]{7,40})\b")
HEADING = re.compile(r"^#{1,6} ", re.MULTILINE)
IN_STRING = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
SCALES = {  # unit -> the factors from a stored value (seconds, fractions, bytes) to the figure
    "%": (1, 100),
    "ms": (1, 1000),
    "min": (1, 1 / 60),
    "minute": (1, 1 / 60),
    "minutes": (1, 1 / 60),
    "h": (1, 1 / 3600),
    "hour": (1, 1 / 3600),
    "hours": (1, 1 / 3600),
    "KiB": (1, 1 / 1024),
    "MiB": (1, 1 / 1024**2),
    "GiB": (1, 1 / 1024**3),
    "KB": (1, 1e-3),
    "MB": (1, 1e-6),
    "GB": (1, 1e-9),
}


def sections(text: str) -> Iterator[tuple[int, int, int]]:
    """(first line number, start, end) of each heading-bounded section of ``prose(text)`` (a
    ``#`` line inside a fenced block is a shell comment, not a heading)."""
    starts = [0, *(m.start() for m in HEADING.finditer(text)), len(text)]
    for begin, end in itertools.pairwise(starts):
        if end > begin:
            yield text.count("\n", 0, begin) + 1, begin, end


def _numbers(value: object, out: set[float]) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        out.add(float(value))
    elif isinstance(value, str):
        out.update(float(n) for n in IN_STRING.findall(value.replace(",", "")))
    elif isinstance(value, dict):
        for item in value.values():
            _numbers(item, out)
    elif isinstance(value, list):
        for item in value:
            _numbers(item, out)


@cache
def stored(name: str) -> frozenset[float]:
    """Every number in a result file (values, and numbers inside its strings)."""
    out: set[float] = set()
    _numbers(json.loads((RESULTS / name).read_text()), out)
    return frozenset(out)


@cache
def committed(name: str, commit: str) -> frozenset[float] | None:
    """Every number in a result file as it was in ``commit``; None if the commit or the file is
    not in this repository (the figure is then reported, unless the clone is shallow)."""
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:bench/results/{name}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if shown.returncode:
        return None
    out: set[float] = set()
    _numbers(json.loads(shown.stdout), out)
    return frozenset(out)


@cache
def shallow() -> bool:
    flag = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
    )
    return flag.stdout.strip() == "true"


def sourced(number: str, unit: str, values: frozenset[float]) -> bool:
    """Whether a stored value, scaled to the figure's unit and rounded to its decimals, is it."""
    figure = float(number.replace(",", ""))
    decimals = len(number.partition(".")[2])
    scales = SCALES.get(unit.split("/")[0] if unit.endswith("/s") and "B" in unit else unit, (1,))
    return any(round(v * k, decimals) == figure for v in values for k in scales)


def unsourced(page: str) -> list[str]:
    raw = unmarked((REPO / page).read_text(encoding="utf-8"))  # bench/doc_figures.py's markers
    text = prose(raw)
    found = []
    for first, begin, end in sections(text):
        section = text[begin:end]
        cited = sorted(set(CITATION.findall(raw[begin:end])))  # code spans cite too
        missing = [c for c in cited if not (RESULTS / c).is_file()]
        for name in missing:
            found.append(f"{page}:{first}: cites bench/results/{name}, which is not committed")
        values = frozenset().union(*(stored(c) for c in cited if c not in missing))
        checked = []
        for line, written, number, unit in figures(section):
            checked.append((line, number))
            if not sourced(number, unit, values):
                where = f"in {', '.join(cited)}" if cited else "(the section cites no result file)"
                found.append(
                    f"{page}:{first + line - 1}: {number} of {written!r} is in no result file {where}"
                )
        # an earlier run's file is read as committed, whether or not it is still in bench/results/
        names = sorted(set(cited) | set(NAMED.findall(raw[begin:end])))
        commits = sorted(set(AS_COMMITTED.findall(raw[begin:end])))
        earlier: set[float] = set(values)
        missing_history = False
        for commit in commits:
            held = [committed(name, commit) for name in names]
            earlier.update(*(h for h in held if h is not None))
            missing_history |= all(h is None for h in held)
        for line, written, number in headlines(section):
            if (line, number) in checked or sourced(number, "", frozenset(earlier)):
                continue
            if missing_history and shallow():
                continue  # the run it quotes is in history this clone does not have
            where = ", ".join(names) or "(none cited)"
            if commits:
                where += f", now or as committed in {', '.join(commits)}"
            found.append(f"{page}:{first + line - 1}: {number} of {written!r} is in no result file: {where}")
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_measured_figure_has_a_source_in_a_cited_result_file(page: str) -> None:
    problems = unsourced(page)
    assert not problems, f"{len(problems)} figures without a source:\n" + "\n".join(problems)


def test_the_figure_check_finds_what_it_claims_to() -> None:
    """The rule itself: what it takes for a figure, and what it takes for a source."""
    text = f"A run took 8.14 s (0.97{EN_DASH}1.15{TIMES}, 12,600 lines/s); the default is 30 s at 80% and `0.3 s`."
    text += " It used 2.3\nCPU-seconds."
    assert [(n, u) for _, _, n, u in figures(prose(text))] == [
        ("8.14", "s"),
        ("0.97", TIMES),
        ("1.15", TIMES),
        ("12,600", "lines/s"),
        ("2.3", "CPU-seconds"),
    ]
    assert sourced("8.14", "s", frozenset({8.1392}))
    assert not sourced("8.14", "s", frozenset({8.1462}))
    assert sourced("0.35", "%", frozenset({0.00347}))
    assert sourced("10.7", "ms", frozenset({0.01068}))
    assert sourced("1.5", "minutes", frozenset({91.0}))
    assert sourced("12,600", "lines/s", frozenset({12600.0}))
    assert sourced("88.0", "MB", frozenset({87_980_000.0}))
    bold = "**Freight / the engine: 0.886** (0.887, 0.92), **met**, **0.9** and **`1.25`**"
    assert [n for _, _, n in headlines(prose(bold))] == ["0.886"]
    page = "# a\nx 1.5 s\n```sh\n# not a heading\n```\n## b\ny\n"
    assert list(sections(prose(page))) == [(1, 0, 38), (6, 38, 45)]
