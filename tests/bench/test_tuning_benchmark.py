"""bench/tuning.py's targets and the engine baseline's "vLLM's own defaults" flag (pure)."""

from __future__ import annotations

import argparse

from bench.limits import add_engine_arguments, llm_arguments
from bench.tuning import FLOOR, GAIN, targets


def cell(ratio: float) -> dict:
    return {"tuned_over_previous_limit": ratio}


def test_the_gain_must_hold_on_two_workloads_and_none_fall_below_the_limit() -> None:
    met = targets({"unique": cell(1.4), "extract": cell(1.12), "shared_prefix": cell(1.01)})
    assert met["tuned_over_previous_limit_2nd_best"] == {"value": 1.12, "bound": GAIN, "pass": True}
    assert met["tuned_over_previous_limit_lowest"] == {"value": 1.01, "bound": FLOOR, "pass": True}

    one = targets({"unique": cell(1.4), "extract": cell(1.05), "shared_prefix": cell(1.0)})
    assert not one["tuned_over_previous_limit_2nd_best"]["pass"]  # only one workload gained 10%
    below = targets({"unique": cell(1.4), "extract": cell(1.2), "shared_prefix": cell(0.97)})
    assert below["tuned_over_previous_limit_2nd_best"]["pass"]
    assert not below["tuned_over_previous_limit_lowest"]["pass"]  # tuned Freight lost on one


def test_a_single_workload_cannot_meet_the_two_workload_gain() -> None:
    assert not targets({"unique": cell(2.0)})["tuned_over_previous_limit_2nd_best"]["pass"]


def engine_args(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return llm_arguments(parser.parse_args(list(argv)))


def test_zero_sequences_leaves_the_engine_at_vllms_own_default() -> None:
    assert engine_args()["max_num_seqs"] == 64  # the benchmarks' shared limit unless told
    assert engine_args("--max-num-seqs", "256")["max_num_seqs"] == 256
    chosen = engine_args("--max-num-seqs", "0")
    assert "max_num_seqs" not in chosen  # vLLM picks it for the device
    assert "max_num_batched_tokens" not in chosen and "kv_cache_memory_bytes" not in chosen
