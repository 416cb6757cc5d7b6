"""The pure half of `freight models tune`: the grid a pilot measures, what the host's memory
allows, the shape class of a sample, and which measured point is kept."""

from __future__ import annotations

import pytest

from scheduler.engine_tuning import (
    CPU,
    GPU,
    HOST_MEMORY_SHARE,
    NGRAM,
    Baseline,
    GridPoint,
    Measurement,
    MemoryFacts,
    SampleShape,
    choose,
    fitting,
    grid,
    memory_need,
    shape_class,
    speculative_point,
    unfit,
)

GIB = 1024**3


def test_the_cpu_grid_starts_at_the_defaults_and_skips_the_gpu_axes_saying_so() -> None:
    points, notes = grid(Baseline(64, 4096), CPU)
    assert points[0] == GridPoint(64, 4096)
    assert {(p.max_num_seqs, p.max_num_batched_tokens) for p in points} == {
        (s, t) for s in (64, 128, 256) for t in (4096, 8192)
    }
    assert len(points) == len(set(points)) == 6
    assert all(p.gpu_memory_utilization is None and p.cudagraph_capture_sizes is None for p in points)
    assert any("no GPU" in n and "gpu_memory_utilization" in n for n in notes)


def test_given_axes_replace_the_default_ones_and_vllms_refusals_are_left_out() -> None:
    points, notes = grid(Baseline(16, 2048), CPU, seqs=[16, 32, 4096], tokens=[2048])
    assert points == [GridPoint(16, 2048), GridPoint(32, 2048)]
    assert any("seqs=4096 tokens=2048: fewer batched tokens than sequences" in n for n in notes)


def test_a_sample_too_small_to_fill_the_sequences_does_not_measure_them() -> None:
    # 100 lines run alike at 128 and 256 sequences: such a point could win by its token budget
    # alone and carry a sequence count nothing measured
    points, notes = grid(Baseline(64, 4096), CPU, sample_lines=100)
    assert {p.max_num_seqs for p in points} == {64}
    assert {p.max_num_batched_tokens for p in points} == {4096, 8192}
    assert any(
        "seqs=128 tokens=4096: not measured, the sample's 100 lines cannot fill 128" in n for n in notes
    )
    filled, _ = grid(Baseline(64, 4096), CPU, sample_lines=256)
    assert {p.max_num_seqs for p in filled} == {64, 128, 256}
    small, _ = grid(Baseline(64, 4096), CPU, sample_lines=10)  # the defaults are measured whatever the sample
    assert small[0] == GridPoint(64, 4096)


def test_a_field_the_operator_set_is_not_tuned() -> None:
    points, notes = grid(Baseline(8, 2048, frozenset({"max_num_seqs"})), CPU, seqs=[8, 16, 32])
    assert {p.max_num_seqs for p in points} == {8}
    assert {p.max_num_batched_tokens for p in points} == {2048, 4096}
    assert any(n.startswith("max_num_seqs: set on the model (8)") for n in notes)


def test_the_gpu_grid_tries_memory_fractions_and_cuda_graph_sizes() -> None:
    points, notes = grid(Baseline(256, 8192), GPU, seqs=[256], tokens=[8192])
    assert [p.gpu_memory_utilization for p in points[:2]] == [0.9, 0.95]
    assert points[-1].cudagraph_capture_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert points[-1].engine_args()["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]
    }
    assert not any("no GPU" in n for n in notes)


def test_a_points_engine_args_are_vllms_fields() -> None:
    point = speculative_point(GridPoint(32, 4096))
    assert point.engine_args() == {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 4096,
        "speculative_config": NGRAM,
    }
    assert point.engine_args()["speculative_config"] is not NGRAM  # a copy: stored rows never share it
    assert GridPoint().engine_args() == {}


def _facts(available: int, kv: int = GIB) -> MemoryFacts:
    return MemoryFacts(available_bytes=available, weight_bytes=GIB, kv_cache_bytes=kv,
                       kv_bytes_per_token=32 * 1024, hidden_size=4096, intermediate_size=14336,
                       vocab_size=128256, max_model_len=8192)  # fmt: skip


def test_a_point_over_the_hosts_memory_is_left_out_with_the_reason() -> None:
    small, big = GridPoint(64, 2048), GridPoint(1024, 65536)
    need_small, need_big = memory_need(small, _facts(0)), memory_need(big, _facts(0))
    assert GIB + GIB < need_small < need_big
    available = int((need_small + need_big) / 2 / HOST_MEMORY_SHARE)  # room for one of them only
    kept, notes = fitting([small, big], _facts(available))
    assert kept == [small]
    assert len(notes) == 1 and notes[0].startswith("seqs=1024 tokens=65536: needs about")
    # speculation's draft tokens need room for their logits too
    assert memory_need(speculative_point(small), _facts(0)) > need_small


def test_a_kv_cache_under_one_full_sequence_is_refused() -> None:
    facts = _facts(64 * GIB, kv=8192 * 32 * 1024 - 1)
    assert "under one 8192-token sequence" in (unfit(GridPoint(8, 2048), facts) or "")
    assert unfit(GridPoint(8, 2048), _facts(64 * GIB)) is None


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        (SampleShape(10, 10 * 900, 10 * 800, 10 * 8), "prompt-medium.output-short.shared"),
        (SampleShape(10, 10 * 100, 0, 10 * 64), "prompt-short.output-medium.unique"),
        (SampleShape(10, 10 * 3000, 10 * 1000, 10 * 300), "prompt-long.output-long.unique"),
        (SampleShape(0, 0, 0, 0), "prompt-short.output-short.unique"),
    ],
)
def test_shape_classes(shape: SampleShape, expected: str) -> None:
    assert shape_class(shape) == expected


def _m(point: GridPoint, seconds: float, error: str | None = None) -> Measurement:
    return Measurement(point, seconds=seconds, output_tokens=1000, error=error)


def test_the_fastest_point_is_kept_with_only_what_differs_from_the_defaults() -> None:
    base, wide = GridPoint(16, 2048), GridPoint(64, 2048)
    choice = choose([_m(base, 10.0), _m(wide, 8.0), _m(GridPoint(64, 4096), 9.0, "vLLM did not start")])
    assert choice.best.point == wide and choice.baseline.point == base
    assert choice.engine_args == {"max_num_seqs": 64}
    assert choice.gain == pytest.approx(1.25)


def test_a_gain_within_the_noise_margin_keeps_the_defaults() -> None:
    choice = choose([_m(GridPoint(16, 2048), 10.0), _m(GridPoint(32, 2048), 9.8)])
    assert choice.best.point == GridPoint(16, 2048) and choice.engine_args == {}
    assert any("the defaults stand" in n for n in choice.notes)


def test_speculation_is_kept_only_where_it_beats_its_plain_twin() -> None:
    plain = GridPoint(32, 2048)
    slower = choose([_m(GridPoint(16, 2048), 10.0), _m(plain, 5.0), _m(speculative_point(plain), 4.9)])
    assert slower.best.point == plain and "speculative_config" not in slower.engine_args
    assert any(n.startswith("n-gram speculation:") and "not kept" in n for n in slower.notes)
    faster = choose([_m(GridPoint(16, 2048), 10.0), _m(plain, 5.0), _m(speculative_point(plain), 3.0)])
    assert faster.engine_args == {"max_num_seqs": 32, "speculative_config": NGRAM}


def test_nothing_is_chosen_when_the_defaults_did_not_run() -> None:
    with pytest.raises(ValueError, match="the previous defaults did not run"):
        choose(
            [_m(GridPoint(16, 2048), 0.0, "vLLM did not start: out of memory"), _m(GridPoint(32, 2048), 1.0)]
        )
