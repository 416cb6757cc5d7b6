"""What this engine worker runs on, read from the machine (scheduler/engine_defaults.py decides
the engine's sizes from it): a GPU through torch.cuda when torch sees one, else the host's CPU
from /proc/meminfo and the cores this process may run on.

Read once at the worker's start, before vLLM loads anything: the free memory is then what the
other processes of the host (or of the GPU) hold, not this engine's own.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from scheduler.engine_defaults import Device, ModelFootprint

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")


def probe_device(workers_per_host: int = 1, meminfo: Path = MEMINFO) -> Device:
    """The first GPU this process sees, or else the host's CPU and memory."""
    gpu = _gpu(workers_per_host)
    return gpu if gpu is not None else cpu_device(workers_per_host, meminfo)


def cpu_device(workers_per_host: int = 1, meminfo: Path = MEMINFO) -> Device:
    """The host's memory (MemTotal, MemAvailable; 0 where unreadable) and this process's cores."""
    values: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024 if parts[1:] == ["kB"] else int(parts[0])
    except OSError as exc:
        log.warning("%s unreadable (%s): the engine's memory defaults take the floor", meminfo, exc)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return Device(
        kind="cpu",
        name="cpu",
        total_bytes=values.get("MemTotal", 0),
        free_bytes=values.get("MemAvailable", values.get("MemFree", 0)),
        cores=cores,
        workers_per_host=workers_per_host,
    )


def _gpu(workers_per_host: int) -> Device | None:
    """torch.cuda's first device (CUDA or ROCm), or None where torch has none (a CPU build)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            return None
        free, total = torch.cuda.mem_get_info(0)
        capability = tuple(torch.cuda.get_device_capability(0))
        return Device(
            kind="gpu",
            name=str(torch.cuda.get_device_name(0)),
            total_bytes=int(total),
            free_bytes=int(free),
            cores=os.cpu_count() or 1,
            compute_capability=(int(capability[0]), int(capability[1])),
            workers_per_host=workers_per_host,
        )
    except (RuntimeError, AssertionError) as exc:  # a driver that cannot be reached: not a GPU host
        log.warning("torch.cuda reports a device but cannot describe it (%s): sizing as a CPU host", exc)
        return None


def model_footprint(path: str, max_model_len: int | None, dtype: str) -> ModelFootprint:
    """The checkpoint's weights and KV bytes per token at the dtype it is served in (0: unknown),
    and its context (the registry's, else config.json's max_position_embeddings)."""
    from storage.checkpoint_config import read_config
    from workers.checkpoint import model_shape, stored_dtype
    from workers.engine import native_half_precision, serving_dtype

    stored, quantized = stored_dtype(path)
    served = serving_dtype(dtype, stored, quantized, native_half=native_half_precision())
    shape = model_shape(path, served_dtype=served)
    context = max_model_len or 0
    if not context:
        try:
            context = int(read_config(path).get("max_position_embeddings") or 0)
        except (OSError, ValueError, TypeError):
            context = 0
    if shape is None:
        return ModelFootprint(max_model_len=context)
    return ModelFootprint(
        weight_bytes=int(shape.parameters * shape.bytes_per_parameter),
        kv_bytes_per_token=shape.kv_bytes_per_token,
        max_model_len=context,
    )
