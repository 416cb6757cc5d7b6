"""Which dtype an engine serves in: the rule (pure) and what a real engine on this machine does."""

from __future__ import annotations

import pytest

from workers.checkpoint import stored_dtype
from workers.engine import Engine, native_half_precision, serving_dtype


@pytest.mark.parametrize(
    ("requested", "stored", "quantized", "native", "served"),
    [
        ("auto", "bfloat16", False, True, "auto"),  # BF16 hardware: as stored
        ("auto", "bfloat16", False, False, "float32"),  # AVX2-only CPU: emulated BF16 is slow
        ("auto", "float16", False, False, "float32"),
        ("auto", None, False, False, "float32"),  # no dtype in config.json: transformers' BF16 default
        ("auto", "float32", False, False, "auto"),  # already full width
        ("auto", "bfloat16", True, False, "auto"),  # INT4 kernels keep their activation dtype
        ("bfloat16", "bfloat16", False, False, "bfloat16"),  # the operator's FREIGHT_ENGINE_DTYPE wins
        ("float32", "bfloat16", False, True, "float32"),
    ],
)
def test_serving_dtype(requested, stored, quantized, native, served):  # type: ignore[no-untyped-def]
    assert serving_dtype(requested, stored, quantized, native) == served


def test_the_engine_serves_in_the_chosen_dtype(vllm_engine: Engine, demo_model_dir) -> None:  # type: ignore[no-untyped-def]
    stored, quantized = stored_dtype(demo_model_dir)
    chosen = serving_dtype("auto", stored, quantized, native_half_precision())
    assert vllm_engine.dtype == (stored if chosen == "auto" else chosen)
