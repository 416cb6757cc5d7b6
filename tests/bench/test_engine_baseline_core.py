"""bench/engine_baseline.py (pure parts): the core placement it shares with Freight's engine worker,
and the batch fill of its stats run."""

from __future__ import annotations

import os

import pytest

from bench import engine_baseline as eb


def test_the_core_placement_is_told_to_vllm_as_freights_worker_tells_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert eb.choose_core("process") is False
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_fill_is_time_weighted_requests_advanced_per_step() -> None:
    recorder = eb.StepRecorder()
    recorder.samples = [(0.0, 4), (1.0, 4), (2.0, 2), (5.0, 1)]  # (time, requests advanced)
    # steps 1-3 weighted by the time since the step before: 4 x 1 + 2 x 1 + 1 x 3 over 4 x 5
    assert recorder.fill(max_num_seqs=4) == pytest.approx(9 / 20)
    recorder.samples = [(0.0, 4)]
    assert recorder.fill(max_num_seqs=4) is None  # one step: no interval to weigh


class _Outputs:
    def __init__(self, n: int) -> None:
        self.outputs = [object()] * n


class _Core:
    def __init__(self) -> None:
        self.served = [_Outputs(3), _Outputs(0), _Outputs(2)]

    def get_output(self) -> _Outputs:
        return self.served.pop(0)


class _Engine:
    def __init__(self) -> None:
        self.engine_core = _Core()


class _LLM:
    def __init__(self) -> None:
        self.llm_engine = _Engine()


def test_steps_are_counted_only_while_the_stats_run_is_on() -> None:
    llm = _LLM()
    recorder = eb.StepRecorder()
    assert recorder.attach(llm)
    assert len(llm.llm_engine.engine_core.get_output().outputs) == 3  # a measured step: not recorded
    assert recorder.samples == []
    recorder.active = True
    llm.llm_engine.engine_core.get_output()
    llm.llm_engine.engine_core.get_output()
    assert [n for _, n in recorder.samples] == [0, 2]
