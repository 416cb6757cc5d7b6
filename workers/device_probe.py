"""What this engine worker runs on, read from the machine (scheduler/engine_defaults.py decides
the engine's sizes from it): a GPU as vLLM's platform sees it (NVML on CUDA, torch.cuda
elsewhere), else the host's CPU from /proc/meminfo and the cores this process may run on.

Read once at the worker's start, before vLLM loads anything: the free memory is then what the
other processes of the host (or of the GPU) hold, not this engine's own.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

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
    """The first GPU as vLLM's own platform sees it (its device table reads the same total memory
    and name), or None on a CPU build. On CUDA, NVML answers without creating a CUDA context in
    this process, which would hold device memory for the worker's life; elsewhere torch.cuda."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return None
    try:
        total = int(current_platform.get_device_total_memory(0))
        name = str(current_platform.get_device_name(0))
        capability = current_platform.get_device_capability(0)
        free = _gpu_free_bytes(current_platform)
    except Exception as exc:  # a driver that cannot be reached: vLLM's own start will say why
        log.warning("the GPU cannot be described (%s): sizing as vLLM's smaller GPUs", exc)
        return Device(kind="gpu", name="?", workers_per_host=workers_per_host)
    return Device(
        kind="gpu",
        name=name,
        total_bytes=total,
        free_bytes=free,
        cores=os.cpu_count() or 1,
        compute_capability=None if capability is None else (capability.major, capability.minor),
        workers_per_host=workers_per_host,
    )


def _gpu_free_bytes(platform: Any) -> int:
    """Free bytes of the first visible GPU (0: unknown, and the decision keeps vLLM's fraction)."""
    try:
        from vllm.platforms import cuda

        physical = platform.device_id_to_physical_device_id(0)
        cuda.pynvml.nvmlInit()
        try:
            handle = cuda.pynvml.nvmlDeviceGetHandleByIndex(physical)
            return int(cuda.pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        finally:
            cuda.pynvml.nvmlShutdown()
    except Exception:  # ROCm, or no NVML: torch.cuda (which creates a context)
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        return int(free)


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
