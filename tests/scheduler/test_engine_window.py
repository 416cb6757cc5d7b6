"""scheduler/engine_window.py: how many sequences the worker keeps inside vLLM."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.engine_window import (
    KV_BOUND_WAITING_PER_SEQ,
    PREFILL_STEPS_AHEAD,
    WINDOW_PER_SEQ,
    engine_window,
)


def test_slots_bound_keeps_twice_the_batch() -> None:
    assert engine_window(256, 200, False, 2048, 20.0) == WINDOW_PER_SEQ * 256


def test_long_prompts_under_kv_pressure_keep_few_waiting() -> None:
    # the shared-prefix workloads: ~875-token prompts, 64 sequences; 2 * 2048 / 875 -> 5 < 64 / 8
    assert engine_window(64, 40, True, 2048, 875.0) == 40 + round(KV_BOUND_WAITING_PER_SEQ * 64)


def test_tiny_prompts_keep_two_steps_token_budgets_waiting() -> None:
    # 20-token prompts: a step can start 2048 / 20 = 103 of them, not 256 / 8 = 32; the next step
    # runs before the worker tops the engine up, so two steps' worth wait
    assert PREFILL_STEPS_AHEAD == 2
    assert engine_window(256, 40, True, 2048, 20.0) == 40 + 205


def test_no_prompt_seen_yet_is_capped_by_the_full_window() -> None:
    assert engine_window(64, 10, True, 2048, 0.0) == WINDOW_PER_SEQ * 64


@given(
    seqs=st.integers(1, 1024),
    running=st.integers(0, 1024),
    bound=st.booleans(),
    budget=st.integers(1, 65536),
    prompt=st.floats(0, 100_000, allow_nan=False),
)
def test_window_is_between_the_running_batch_and_the_full_window(
    seqs: int, running: int, bound: bool, budget: int, prompt: float
) -> None:
    window = engine_window(seqs, min(running, seqs), bound, budget, prompt)
    full = WINDOW_PER_SEQ * seqs
    assert 1 <= window <= full
    if bound:  # always room for at least two to start beside the running ones (within the cap)
        assert window >= min(full, min(running, seqs) + 2)
