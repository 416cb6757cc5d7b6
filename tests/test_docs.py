"""The documentation against the code (pure: reads files and the click tree, starts nothing).

- every FREIGHT_* setting of ``storage/settings.py`` has a row in docs/configuration.md with a
  default and a meaning, and every FREIGHT_* name written in README.md or docs/ exists;
- every ``freight ...`` command and option and every ``make`` target the docs name exists;
- the README's code map names only paths that exist, and every top-level package;
- every relative link between the pages points at a file (and heading) that exists.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest

from api.cli import main as freight_cli
from bench import doc_figures
from storage.settings import Settings

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
SETTINGS = {f"FREIGHT_{f.name.upper()}" for f in fields(Settings)}
NAME = re.compile(r"FREIGHT_[A-Z0-9_*]*[A-Z0-9*]")
# where code is searched for the variables that are not settings (client, install and test scripts)
SOURCES = ("api", "bench", "examples", "infra", "scheduler", "storage", "tests", "workers", "Makefile")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row of ``text``."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.lstrip().startswith("|") and not re.fullmatch(r"\|[\s|:-]+\|?", line.strip())
    ]


def _other_variables() -> set[str]:
    """The names of configuration.md's table of variables outside the settings."""
    text = CONFIGURATION.read_text()
    section = text[text.index("## Variables outside the settings") :]
    return {name for row in _table_rows(section) for name in NAME.findall(row[0])}


def test_every_setting_has_a_row_with_default_and_meaning() -> None:
    documented: dict[str, list[str]] = {}
    for row in _table_rows(CONFIGURATION.read_text()):
        for name in NAME.findall(row[0]):
            documented[name] = row
    missing = sorted(SETTINGS - documented.keys())
    assert not missing, f"settings with no row in docs/configuration.md: {missing}"
    for name in sorted(SETTINGS):
        row = documented[name]
        assert len(row) >= 3 and row[1] and row[2], f"{name}: its row needs a default and a meaning: {row}"


def _shown(default: object) -> str:
    """A default as the configuration table writes it."""
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return ",".join(default)
    return f"{default:g}" if isinstance(default, float) else str(default)


def test_the_documented_defaults_are_the_codes() -> None:
    """Each literal default in the table is the dataclass's; empty ones (derived at start-up, or
    off) are described in words and not compared."""
    rows = {name: row for row in _table_rows(CONFIGURATION.read_text()) for name in NAME.findall(row[0])}
    wrong = []
    for f in fields(Settings):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if default in ("", (), {}):
            continue
        row = rows[f"FREIGHT_{f.name.upper()}"]
        position = NAME.findall(row[0]).index(f"FREIGHT_{f.name.upper()}")
        shown = SPAN.findall(row[1])
        if position >= len(shown) or shown[position] not in {_shown(default), str(default)}:
            wrong.append(f"FREIGHT_{f.name.upper()}: code {default!r}, docs {row[1]!r}")
    assert not wrong, "\n".join(wrong)


def test_every_documented_name_exists() -> None:
    others = _other_variables()
    assert not others & SETTINGS, "a setting is listed among the variables outside the settings"
    wrong = []
    for page in PAGES[:-1]:  # README.md and docs/
        for name in set(NAME.findall(page.read_text())):
            if "*" in name:
                if not fnmatch.filter(SETTINGS, name):
                    wrong.append(f"{_rel(page)}: {name} matches no setting")
            elif name not in SETTINGS and name not in others:
                wrong.append(f"{_rel(page)}: {name} is neither a setting nor a documented variable")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_variables_outside_the_settings_are_read_somewhere() -> None:
    code = []
    for source in SOURCES:
        path = REPO / source
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in {".py", ".sh", ""}]
        code += [p.read_text(errors="replace") for p in files if p.is_file() and p != Path(__file__)]
    text = "\n".join(code)
    unread = sorted(name for name in _other_variables() if not re.search(rf"\b{name}\b", text))
    assert not unread, f"documented but read nowhere: {unread}"


# --- commands ------------------------------------------------------------------------------------

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
FREIGHT = re.compile(r"(?<![\w./-])freight((?: [a-z][a-z/-]*)+)(.*)")
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def _command_texts(page: Path) -> list[str]:
    """Lines of shell code blocks (continuations joined, prompts and comments cut) and inline
    code spans of ``page`` that run something."""
    text = page.read_text()
    found = []
    for lang, body in FENCE.findall(text):
        if lang in {"python", "yaml", "json"}:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            found.append(line.removeprefix("$ ").split("  #")[0].split(" # ")[0])
    prose = FENCE.sub("", text)
    found += SPAN.findall(prose)
    return found


def _freight_commands() -> list[tuple[str, str]]:
    return [(_rel(page), text) for page in PAGES for text in _command_texts(page) if FREIGHT.search(text)]


def _check(text: str) -> str | None:
    """None if ``text``'s ``freight WORDS [options]`` is a command with those options, else why not."""
    match = FREIGHT.search(text)
    assert match
    words, rest = match.group(1).split(), match.group(2)
    ctx = click.Context(freight_cli, info_name="freight")
    # `freight models add/list/remove`: alternatives at one level, each checked
    alternatives = [(freight_cli, ctx, words)]
    leaves = []
    while alternatives:
        command, ctx, left = alternatives.pop()
        if not isinstance(command, click.Group) or not left:
            leaves.append((command, left))
            continue
        for word in left[0].split("/"):
            sub = command.get_command(ctx, word)
            if sub is None:
                return f"{word!r} is not a subcommand of {command.name!r}"
            alternatives.append((sub, click.Context(sub, info_name=word, parent=ctx), left[1:]))
    for command, _ in leaves:
        if isinstance(command, click.Group):
            continue  # `freight tenant` alone: a group named in prose
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        known |= {"-h", "--help"}
        for option in OPTION.findall(rest):
            if option not in known:
                return f"{command.name!r} has no option {option}"
    return None


def test_the_docs_name_freight_commands() -> None:
    assert len(_freight_commands()) > 50  # the scan finds the command lines


@pytest.mark.parametrize(("page", "text"), _freight_commands())
def test_every_freight_command_exists(page: str, text: str) -> None:
    problem = _check(text)
    assert problem is None, f"{page}: `{text.strip()}`: {problem}"


def test_every_make_target_exists() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    wrong = []
    for page in PAGES:
        for text in _command_texts(page):
            for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", text):
                if target not in targets:
                    wrong.append(f"{_rel(page)}: make {target}")
    assert not wrong, "\n".join(wrong)


# --- code map ------------------------------------------------------------------------------------


def _code_map() -> list[str]:
    text = README.read_text()
    start = text.index("### Code map")
    return text[start : text.index("\n## ", start)].splitlines()[1:]


def _code_map_paths() -> list[str]:
    """Every file or folder path the code map names, relative to the repository."""
    paths, package = [], ""
    for line in _code_map():
        spans = [s for s in SPAN.findall(line) if re.fullmatch(r"[\w./-]+", s) and not s.startswith(".")]
        spans = [s for s in spans if s.endswith("/") or re.search(r"\.(py|sh)$", s) or s == "Dockerfile"]
        top = re.match(r"- \*\*`([\w-]+/)`\*\*", line)
        if top:
            package = top.group(1)
            paths.append(package)
            spans = spans[1:]
        for span in spans:  # relative to the package of its bullet, else to the repository
            path = package + span
            if not package or (
                not (REPO / path).exists() and "/" in span.rstrip("/") and (REPO / span).exists()
            ):
                path = span
            paths.append(path)
    return paths


def test_the_code_map_names_paths_that_exist() -> None:
    paths = _code_map_paths()
    assert len(paths) > 60
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"the README's code map names paths that do not exist: {missing}"


def test_the_code_map_names_every_top_level_package() -> None:
    text = "\n".join(_code_map())
    packages = sorted(
        p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py"))
    )
    assert "scheduler" in packages and "tests" in packages
    missing = [p for p in packages if f"`{p}/`" not in text]
    assert not missing, f"top-level packages the code map leaves out: {missing}"


# --- links ---------------------------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves() -> None:
    wrong = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                wrong.append(f"{_rel(page)}: {target}")
                continue
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", FENCE.sub("", file.read_text()), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    wrong.append(f"{_rel(page)}: {target} (no such heading)")
    assert not wrong, "\n".join(wrong)


# --- benchmark table -----------------------------------------------------------------------------

RESULTS = REPO / "bench" / "results"


def _benchmark_rows() -> list[list[str]]:
    text = README.read_text()
    start = text.index("## Benchmarks")
    section = text[start : text.index("\n## ", start + 1)]
    return [row for row in _table_rows(section) if row[0] != "target"]


def _family(name: str) -> str:
    """The benchmark a result file is of: scheduler-cache-modes.json's is scheduler's (the same
    target key in two benchmarks, uploads' and input_order's api_rss_increase_mb, is two targets)."""
    return name.removesuffix(".json").split("-")[0]


def _targets() -> dict[str, dict[str, tuple[str, float]]]:
    """targets key -> {result file: (its date or "", value)} over every result file that measured it."""
    found: dict[str, dict[str, tuple[str, float]]] = {}
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("quick"):
            continue  # `--quick` is a smoke test of the plumbing, not a measurement
        for key, target in (data.get("targets") or {}).items():
            if target.get("value") is not None:
                found.setdefault(key, {})[path.name] = (data.get("generated_at", ""), target["value"])
    return found


def test_the_benchmark_table_shows_each_targets_latest_figure() -> None:
    targets = _targets()
    shown = set()
    for row in _benchmark_rows():
        spans = SPAN.findall(row[5])
        key = spans[-1]
        shown.add(key)
        if row[2] == "not measured yet":
            assert key not in targets, f"{key} has been measured: {targets.get(key)}"
            continue
        file = spans[0]
        assert file in targets.get(key, {}), f"{file} has no figure for {key}"
        date, _ = targets[key][file]
        latest = max(d for f, (d, _) in targets[key].items() if _family(f) == _family(file))
        assert date == latest, f"{key}: a later result than {file} ({date}) exists: {targets[key]}"
    # every target of the result files has its row (request_rate.json's is control_plane.json's)
    missing = sorted(set(targets) - shown - {"freight_over_engine"})
    assert not missing, f"targets without a row in the README's benchmark table: {missing}"


def test_the_benchmark_table_is_exactly_what_the_result_files_give() -> None:
    """Every cell (figure, bound, pass, machine and date) as bench/readme_table.py renders it from
    the committed result files: `make bench-table` rewrites it after a run."""
    from bench import readme_table

    assert readme_table.readme_table(README.read_text()) == readme_table.render(), "run make bench-table"
    assert not readme_table.unmapped(), (
        f"targets without a row in bench/readme_table.ROWS: {readme_table.unmapped()}"
    )


@pytest.mark.parametrize("page", doc_figures.pages())
def test_the_docs_figures_are_exactly_what_the_result_files_give(page: str) -> None:
    """Every measured figure of the README's prose and of docs/ (bench/doc_figures.FIGURE and
    its bold headlines) carries a bench/doc_figures.py marker, and is written exactly as the marker's
    result file gives it: `make bench-table` rewrites them after a run."""
    raw = (REPO / page).read_text()
    assert doc_figures.render(raw) == raw, f"{page}: run make bench-table"
    marked = set(doc_figures.markers(raw))
    text = doc_figures.prose(doc_figures.unmarked(raw))
    found = {(line, number) for line, _, number, _ in doc_figures.figures(text)}
    found |= {(line, number) for line, _, number in doc_figures.headlines(text)}
    assert not found - marked, f"{page}: figures without a marker (line, number): {sorted(found - marked)}"


def test_the_estimate_row_quotes_one_pass_and_shows_the_other() -> None:
    from bench import readme_table

    (row,) = [r for r in _benchmark_rows() if "`estimate_cost_worst_factor`" in r[5]]
    data = json.loads((RESULTS / "estimates.json").read_text())
    passes = readme_table._estimate_passes(data, data["targets"]["estimate_cost_worst_factor"])
    assert len(passes) == 2 and row[2].startswith(
        f"{data['targets']['estimate_cost_worst_factor']['value']:.2f} (pass 2;"
    )
    assert f"pass 1: {passes['1']:.2f}" in row[2]
