"""`--quantization auto` picks INT4 only where a recorded probe says it pays."""

from __future__ import annotations

from workers.probe import choose, speedups

CPU_PROBE = {"bf16": {"1": 22.0, "16": 164.0}, "int4": {"1": 13.6, "16": 80.0}}  # measured here before
GPU_LIKE = {"bf16": {"1": 40.0, "16": 500.0}, "int4": {"1": 120.0, "16": 900.0}}
MIXED = {"bf16": {"1": 19.6, "16": 138.0}, "int4": {"1": 18.1, "16": 198.0}}  # zentorch: wins at 16 only


def test_int4_is_kept_only_if_it_is_faster_at_every_batch_size() -> None:
    assert choose(CPU_PROBE, 1.0) == "none"
    assert choose(GPU_LIKE, 1.0) == "w4a16"
    assert choose(MIXED, 1.0) == "none"


def test_the_threshold_is_the_operators_choice() -> None:
    assert choose(MIXED, 0.9) == "w4a16"
    assert choose(GPU_LIKE, 2.0) == "none"  # 1.8x at batch 16 is not 2x


def test_an_incomplete_probe_keeps_bf16() -> None:
    assert choose({"bf16": {}, "int4": {}}, 1.0) == "none"
    assert choose({"bf16": {"1": 1.0}, "int4": {"16": 5.0}}, 1.0) == "none"


def test_speedups_are_per_batch_ratios() -> None:
    assert speedups(CPU_PROBE) == {"1": 0.618, "16": 0.488}


def test_a_machine_without_an_int4_kernel_keeps_bf16() -> None:
    probe = {"bf16": {"1": 22.0, "16": 164.0}, "int4": {}}  # run_probe's record of such a machine
    assert choose(probe, 1.0) == "none"
    assert speedups(probe) == {}
