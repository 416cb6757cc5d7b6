"""bench/cpu.py: which control role a process title names (pure)."""

from __future__ import annotations

import pytest

from bench.cpu import control_role_of


@pytest.mark.parametrize(
    ("title", "role"),
    [
        ("[celeryd: control-validate@vm:ForkPoolWorker-3]", "validate"),
        ("[celeryd: control-tick@vm:MainProcess] -active- (worker --control --role tick)", "tick"),
        ("[celeryd: control-finalize@host-2.example:ForkPoolWorker-1]", "finalize"),
        ("[celeryd: control-webhook@vm:MainProcess] -active- (worker --control --role webhook)", "webhook"),
        ("/work/main/.venv/bin/python -m workers.bootstrap worker --control", "supervisor"),
        ("[celeryd: engine-demo@vm:MainProcess] -active- (worker --model demo)", "supervisor"),
    ],
)
def test_each_process_of_the_control_plane_counts_for_its_role(title: str, role: str) -> None:
    assert control_role_of(title) == role
