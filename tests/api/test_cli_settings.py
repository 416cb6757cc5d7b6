"""Every `freight` command builds its settings the same way: a bad `FREIGHT_*` value is one clear
line naming the variable, never a traceback (the `models` group used to print one)."""

from __future__ import annotations

import os

import pytest

from tests.factories import run_freight


@pytest.mark.parametrize(
    "argv",
    [
        ["models", "list"],
        ["db", "upgrade"],
        ["tenant", "create", "x"],
        ["worker", "--control"],
        ["beat"],
        ["tick"],
    ],
)
def test_a_bad_setting_is_one_clear_line(argv: list[str], tmp_path) -> None:
    env = {**os.environ, "FREIGHT_TICK_SECONDS": "soon", "FREIGHT_DATA_DIR": str(tmp_path)}
    done = run_freight(*argv, env=env, cwd=tmp_path)
    assert done.returncode != 0
    assert "FREIGHT_TICK_SECONDS" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("argv", [["api"], ["worker", "--control"], ["beat"]])
def test_a_placeholder_secret_stops_every_process_before_it_starts(argv: list[str], tmp_path) -> None:
    """The k8s Secret's CHANGE-ME left in place: `/metrics` answered 200 to `Bearer CHANGE-ME`.
    Now no process starts on it, and the line names the setting."""
    env = {**os.environ, "FREIGHT_METRICS_TOKEN": "CHANGE-ME", "FREIGHT_DATA_DIR": str(tmp_path)}
    done = run_freight(*argv, env=env, cwd=tmp_path)
    assert done.returncode != 0
    assert "FREIGHT_METRICS_TOKEN holds a placeholder" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
