"""Utilization: how busy an engine's accelerator was, from the tokens it served (MFU and MBU).

Units: FLOP/s, bytes/s and bytes; time in seconds. Pure functions; the worker's cost meter
(``workers.cost_meter``) feeds them measured periods.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.cost import TokenWork


@dataclass(frozen=True)
class Accelerator:
    peak_flops: float  # FLOP/s of the whole worker's accelerator(s), dense, at the serving dtype
    memory_bandwidth: float  # bytes/s
    memory_bytes: int


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    bytes_per_parameter: float
    kv_bytes_per_token: int  # all layers, K and V


def model_flops(work: TokenWork, model: ModelShape) -> float:
    """2 * parameters FLOPs per token computed (uncached prompt tokens and output tokens).

    Attention FLOPs are left out: at these context lengths they are small next to the weight matmuls,
    so this slightly understates the work and MFU is a lower bound.
    """
    return 2.0 * model.parameters * (work.uncached_tokens + work.output_tokens)


def mfu(work: TokenWork, seconds: float, model: ModelShape, acc: Accelerator) -> float | None:
    """Model FLOPs utilisation: model_flops / (seconds * peak_flops); None without time or a peak."""
    if seconds <= 0 or acc.peak_flops <= 0:
        return None
    return model_flops(work, model) / (seconds * acc.peak_flops)


def mbu(steps: int, work: TokenWork, seconds: float, model: ModelShape, acc: Accelerator) -> float | None:
    """Memory bandwidth utilisation: each engine step reads every weight once, and decode reads
    ``work.kv_tokens_read`` KV entries; bytes over (seconds * memory_bandwidth). None without time
    or a bandwidth."""
    if seconds <= 0 or acc.memory_bandwidth <= 0:
        return None
    weights = steps * model.parameters * model.bytes_per_parameter
    return (weights + work.kv_tokens_read * model.kv_bytes_per_token) / (seconds * acc.memory_bandwidth)


def utilization_columns(
    work: TokenWork, seconds: float, steps: int, model: ModelShape | None, acc: Accelerator
) -> dict[str, float | int | None]:
    """The MFU and MBU estimates of a recorded unit or an engine sample, with the model size they
    assume (every one None without the model's shape; MFU or MBU None without the accelerator's
    figures)."""
    if model is None:
        return {"model_parameters": None, "bytes_per_parameter": None, "mfu": None, "mbu": None}
    return {
        "model_parameters": model.parameters,
        "bytes_per_parameter": model.bytes_per_parameter,
        "mfu": mfu(work, seconds, model, acc),
        "mbu": mbu(steps, work, seconds, model, acc),
    }
