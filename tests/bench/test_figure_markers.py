"""bench/doc_figures.py: how a marked figure of the docs is written from its result file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import doc_figures
from bench.doc_figures import FigureError, formatted, lookup, render, unmarked

DATA = {
    "targets": {"shared_prefix_tight_kv.freight_over_limit": {"value": 1.0137}},
    "runs": {"chunks_2#0": {"seconds": 35.4211, "lines_per_s": 28233.6}},
    "repeats": [{"share": 0.7698}, {"share": 0.8}],
    "label": "x",
}


def test_a_path_goes_through_keys_holding_dots_and_list_items() -> None:
    assert lookup(DATA, "targets.shared_prefix_tight_kv.freight_over_limit.value") == 1.0137
    assert lookup(DATA, "runs.chunks_2#0.seconds") == 35.4211
    assert lookup(DATA, "repeats.1.share") == 0.8
    for bad in ("targets.nope.value", "repeats.2.share", "repeats.x", "label.more"):
        with pytest.raises(FigureError):
            lookup(DATA, bad)


def test_a_number_keeps_its_written_precision_and_separators() -> None:
    assert formatted(28233.6, "27,040") == "28,234"
    assert formatted(35.4211, "36.98") == "35.42"
    assert formatted(1.0, "1.3") == "1.0"


def test_render_writes_each_marked_number_from_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t.json").write_text(json.dumps(DATA))
    monkeypatch.setattr(doc_figures, "RESULTS_DIR", tmp_path)
    doc_figures._load.cache_clear()
    page = (
        "two processes 99.99<!-- fig t.json:runs.chunks_2#0.seconds --> s (1<!-- fig t.json:runs.chunks_2#0.lines_per_s -->"
        " lines/s), **0.5<!-- fig t.json:targets.shared_prefix_tight_kv.freight_over_limit.value -->**,"
        " 1.0<!-- fig t.json:repeats.0.share *100 -->% cached, 0.2 s unmarked"
    )
    written = render(page)
    assert unmarked(written) == (
        "two processes 35.42 s (28234 lines/s), **1.0**, 77.0% cached, 0.2 s unmarked"
    )
    assert render(written) == written  # written once, it stays
    with pytest.raises(FigureError, match=r"t\.json:label is .x., not a number"):
        render("3.1<!-- fig t.json:label -->")
    with pytest.raises(FigureError, match=r"nope\.json is not committed"):
        render("3.1<!-- fig nope.json:a -->")
    doc_figures._load.cache_clear()
