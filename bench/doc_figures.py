"""The measured figures of the README's prose and of ``docs/``, written from the result files.

A reader of ``docs/`` or the README meets a figure ("a million requests finalized in 15.73 s")
far from the run that made it; the benchmark table is generated (``bench/readme_table.py``), and
so is every figure of the prose here. Each carries a marker right after its number naming where it
comes from, which a Markdown renderer hides::

    finalized in 15.73<!-- fig finalization.json:targets.finalize_seconds.value --> s
    **0.9013<!-- fig lora.json:targets.freight_vs_engine_lora.value -->**

``FILE`` is a file of ``bench/results/`` (``FILE@COMMIT``: the file as committed in ``COMMIT``,
for a page quoting an earlier run); ``PATH`` is its dotted path, list items by index (a key that
itself holds dots, as ``targets`` keys do, is matched whole); an optional scale converts the
stored unit to the written one (``*100``: a fraction as a percentage; ``*1000``: seconds as
milliseconds; ``/60``: seconds as minutes). ``python -m bench.doc_figures --write`` (``make
bench-table``) rewrites every marked number from its file, keeping the decimals and the thousands
separators it is written with, so changing a figure's precision is an edit of the page and
changing its value is a run. ``tests/test_docs.py`` fails if a page is not what this writes, and
if a measured figure of these pages (``FIGURE`` and the bold headlines below: the rule the
sourcing check of ``tests/test_doc_figures.py`` applies too) has no marker. Nothing is read at
import: ``pages()`` lists the pages when asked.

``docs/reliability.md`` is written whole by its benchmark (``bench/reliability_doc.py``);
``bench/README.md``, the methods and the history of every run, quotes earlier runs by commit and
is checked by ``tests/test_doc_figures.py`` instead.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from typing import Any

from bench.provenance import REPO, RESULTS_DIR

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
MARKER = re.compile(
    rf"(?P<number>{NUMBER})<!-- fig (?P<file>[\w.-]+\.json)(?:@(?P<commit>[0-9a-f]{{7,40}}))?"
    r":(?P<path>\S+?)(?: (?P<scale>[*/]\d+(?:\.\d+)?))? -->"
)


# What a measured figure is, for the check that each has a marker (tests/test_docs.py) and the
# check that each has a source (tests/test_doc_figures.py): see the latter's docstring.
TIMES, EN_DASH = "\u00d7", "\u2013"  # the multiplication sign, the en dash
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
DECIMAL = r"\d{1,3}(?:,\d{3})*\.\d+|\d+\.\d+"
# a unit after a number with decimals (a space allowed before it); each alternative ends a word
UNITS = (
    TIMES + r"|x(?![\w])|%|ms\b|s\b|seconds?\b|minutes?\b|min\b|h\b|hours?\b|KiB\b|MiB\b|GiB\b|KB\b|MB\b|GB\b"
    r"|CPU-s\b|CPU[- ]seconds?\b"
)
RATES = r"(?:tok(?:ens)?|lines|req(?:uests)?|rows|steps|packs|units|batches|claims|MB|MiB|GB|GiB)/s\b"
FIGURE = re.compile(
    rf"(?<![\w.,/-])(?P<low>{DECIMAL})(?:\s?[{EN_DASH}-]\s?(?P<high>{DECIMAL}))?\s*(?P<unit>{UNITS})"
    rf"|(?<![\w.,/-])(?P<rate_low>{NUMBER})(?:\s?[{EN_DASH}-]\s?(?P<rate_high>{NUMBER}))?\s*(?P<rate>{RATES})"
)
BOLD = re.compile(r"\*\*([^*\n]+?)\*\*")
HEADLINE = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})*\.\d{2,}|\d+\.\d{2,})(?![\w.])")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
TABLE = re.compile(r"<!-- benchmark table:.*?<!-- end of the benchmark table -->", re.DOTALL)


class FigureError(ValueError):
    """A marker naming a file, a commit or a path that holds no number."""


@cache
def _load(name: str, commit: str | None) -> Any:
    if commit is None:
        path = RESULTS_DIR / name
        if not path.is_file():
            raise FigureError(f"bench/results/{name} is not committed")
        return json.loads(path.read_text())
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:bench/results/{name}"], capture_output=True, text=True
    )
    if shown.returncode:
        raise FigureError(f"bench/results/{name} is not in commit {commit}")
    return json.loads(shown.stdout)


def lookup(data: Any, path: str) -> Any:
    """The value at dotted ``path``; a dict key holding dots is matched whole, longest first."""
    parts = path.split(".")
    while parts:
        if isinstance(data, list):
            head = parts.pop(0)
            if not head.lstrip("-").isdigit() or not -len(data) <= int(head) < len(data):
                raise FigureError(f"no item {head}")
            data = data[int(head)]
            continue
        if not isinstance(data, dict):
            raise FigureError(f"{'.'.join(parts)} goes below a value")
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if key in data:
                data, parts = data[key], parts[n:]
                break
        else:
            raise FigureError(f"no key {parts[0]!r}")
    return data


def value_of(match: re.Match[str]) -> float:
    """The number a marker names, scaled to the written unit."""
    where = f"{match['file']}{'@' + match['commit'] if match['commit'] else ''}:{match['path']}"
    try:
        value = lookup(_load(match["file"], match["commit"]), match["path"])
    except FigureError as exc:
        raise FigureError(f"{where}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FigureError(f"{where} is {value!r}, not a number")
    scale = match["scale"]
    if scale:
        factor = float(scale[1:])
        return value * factor if scale[0] == "*" else value / factor
    return float(value)


def formatted(value: float, like: str) -> str:
    """``value`` with the decimals and thousands separators of ``like`` (the number as written)."""
    decimals = len(like.partition(".")[2])
    return f"{value:{',' if ',' in like else ''}.{decimals}f}"


def render(text: str) -> str:
    """``text`` with every marked number written from its result file."""

    def write(match: re.Match[str]) -> str:
        number = formatted(value_of(match), match["number"])
        return number + match.group(0)[len(match["number"]) :]

    return MARKER.sub(write, text)


def markers(text: str) -> Iterator[tuple[int, str]]:
    """(line, number) of every marked number."""
    for match in MARKER.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match["number"]


def unmarked(text: str) -> str:
    """``text`` without its markers (each number stays): what a reader of the page sees."""
    return MARKER.sub(lambda match: match["number"], text)


def _blank(match: re.Match[str]) -> str:
    """The match's text as spaces and its newlines: positions and line numbers stay put."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    for pattern in (TABLE, FENCE, CODE_SPAN):
        text = pattern.sub(_blank, text)
    return text


def headlines(text: str) -> Iterator[tuple[int, str, str]]:
    """(line, the bold text, its number) of every bold number with two decimals or more."""
    for match in BOLD.finditer(text):
        for number in HEADLINE.finditer(match.group(1)):
            yield text.count("\n", 0, match.start()) + 1, match.group(0), number.group(1)


def figures(text: str) -> Iterator[tuple[int, str, str, str]]:
    """(line, the figure as written, its number, its unit) of every checked figure of a section."""
    for match in FIGURE.finditer(text):
        unit = match.group("unit") or match.group("rate")
        ends = ("low", "high") if match.group("unit") else ("rate_low", "rate_high")
        for end in ends:
            if match.group(end):
                line = text.count("\n", 0, match.start()) + 1
                yield line, match.group(0).replace("\n", " "), match.group(end), unit


def pages() -> list[str]:
    """The pages whose figures this writes (docs/reliability.md: bench/reliability_doc.py writes it)."""
    docs = sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md") if p.name != "reliability.md")
    return ["README.md", *docs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite the pages (else list those out of date)"
    )
    args = parser.parse_args(argv)
    for page in pages():
        path = REPO / page
        text = path.read_text()
        new = render(text)
        if new != text:
            print(f"{page}: {'written' if args.write else 'out of date'}")
            if args.write:
                path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
