"""An engine's batch and KV-cache sizes when the operator and the model's registry row set none.

Freight's old defaults (64 sequences, a 1 GiB KV cache) were the demo's: on an 80 GB GPU that is
a few thousand tokens of an 8B model's cache. The sizes here follow the device instead:

* **GPU**: vLLM's own offline defaults (``EngineArgs.get_batch_defaults`` for ``LLM_CLASS``, vLLM
  0.32): 1,024 sequences and 16,384 batched tokens on a device of at least 70 GiB that is not an
  A100 (H100, H200, B200, MI300X), else 256 and 8,192; the KV cache is what vLLM's memory
  fraction ``gpu_memory_utilization`` (0.92) of the device leaves after the weights and
  activations, vLLM's own sizing. Where another process already holds part of the device, the
  fraction shrinks to what is free (vLLM refuses to start on a fraction larger than the free
  memory). None of this is measured here: no GPU can run vLLM on these machines.
* **CPU**: vLLM-CPU's offline defaults are 256 sequences and 4,096 batched tokens per engine, and
  a KV cache of 0.92 of the node's memory minus the process's own, which leaves nothing for the
  OS, Freight's other processes or a second engine worker. Freight keeps room for those first
  (``OS_RESERVE_*``), splits the rest between the host's engine workers, takes the weights and the
  runtime's own memory off each share and gives ``CPU_KV_SHARE`` of what is left to the KV cache,
  at most what ``KV_CONTEXTS`` full batches of full contexts fill; sequences scale with the
  worker's cores (``CPU_SEQS_PER_CORE``) up to vLLM's 256, and never more than the cache holds at
  ``MIN_TOKENS_PER_SEQ`` each.

Pure: the device and model come in described (workers/device_probe.py reads them), the sizes and
the reason for each go out, so every rule is unit-tested with device descriptions of machines
that are not here.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
# vLLM's EngineArgs.get_batch_defaults, UsageContext.LLM_CLASS (vLLM 0.32; tests compare the two)
GPU_LARGE_MEMORY = 70 * GIB  # at or above it, and not an A100: the large budgets
GPU_HUGE_MEMORY = 160 * GIB  # at or above it (B200, B300, MI300X): the large budgets, A100 or not
GPU_LARGE = (1024, 16384)  # (max_num_seqs, max_num_batched_tokens)
GPU_OTHER = (256, 8192)
# vLLM's CacheConfig.gpu_memory_utilization default: the share of the device one engine may take
GPU_MEMORY_UTILIZATION = 0.92
GPU_FREE_MARGIN = 0.02  # of the device, kept below what is free when others already hold part
CPU_MAX_SEQS = 256  # vLLM-CPU's LLM_CLASS max_num_seqs per engine (world size 1)
CPU_BATCHED_TOKENS = 4096  # vLLM-CPU's LLM_CLASS max_num_batched_tokens per engine
CPU_SEQS_PER_CORE = 64  # sequences per core of the worker's share, up to CPU_MAX_SEQS
CPU_MIN_SEQS = 16
OS_RESERVE_BYTES = 2 * GIB  # the OS and a worker host's other processes (broker, API, control)...
OS_RESERVE_SHARE = 0.10  # ...or this share of the memory, whichever is more
RUNTIME_BYTES = 3 * GIB // 2  # an engine worker's own memory besides weights and KV (torch, vLLM)
CPU_KV_SHARE = 0.75  # of a worker's memory after weights and runtime; the rest: activations, feed
KV_CONTEXTS = 2  # the KV cache holds at most this many full batches of full contexts
MIN_TOKENS_PER_SEQ = 512  # KV tokens each running sequence should find, on average
CPU_MIN_KV_BYTES = 256 * 1024**2  # below this the host is too small to size anything: this floor


@dataclass(frozen=True)
class Device:
    """What one engine worker runs on. Memory in bytes; for a GPU the first device the worker
    sees (tensor-parallel workers see several of the same kind), for a CPU the host's."""

    kind: str  # "cpu" or "gpu"
    name: str = ""  # "NVIDIA H100 80GB HBM3", "cpu"
    total_bytes: int = 0
    free_bytes: int = 0  # GPU: free now; CPU: MemAvailable now
    cores: int = 0  # CPU cores this process may run on
    compute_capability: tuple[int, int] | None = None  # GPUs: informative only (vLLM ignores it)
    workers_per_host: int = 1  # engine workers sharing the host's memory and cores (CPU)


@dataclass(frozen=True)
class ModelFootprint:
    """What the model needs besides its KV cache, and what a token of cache costs (0: unknown)."""

    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    max_model_len: int = 0


@dataclass(frozen=True)
class EngineDefaults:
    """The sizes for a device. ``kv_cache_bytes`` None: vLLM sizes the cache from
    ``gpu_memory_utilization`` (GPUs); ``reason`` says why each value, for the start-up log."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int | None
    gpu_memory_utilization: float | None
    reason: str


def engine_defaults(device: Device, model: ModelFootprint | None = None) -> EngineDefaults:
    """The sizes an engine of ``model`` gets on ``device`` when nothing else sets them."""
    if device.kind == "gpu":
        return _gpu(device)
    return _cpu(device, model or ModelFootprint())


def _gpu(device: Device) -> EngineDefaults:
    large = device.total_bytes >= GPU_HUGE_MEMORY or (
        device.total_bytes >= GPU_LARGE_MEMORY and "a100" not in device.name.lower()
    )
    seqs, tokens = GPU_LARGE if large else GPU_OTHER
    why = "at least 70 GiB, not an A100" if large else "under 70 GiB or an A100"
    fraction = GPU_MEMORY_UTILIZATION
    note = ""
    if device.total_bytes > 0 and 0 < device.free_bytes < fraction * device.total_bytes:
        fraction = round(max(0.05, device.free_bytes / device.total_bytes - GPU_FREE_MARGIN), 3)
        note = f", lowered from {GPU_MEMORY_UTILIZATION} to what is free ({_gib(device.free_bytes)} GiB)"
    reason = (
        f"GPU {device.name or '?'} ({_gib(device.total_bytes)} GiB, {why}): vLLM's offline defaults "
        f"max_num_seqs={seqs}, max_num_batched_tokens={tokens}; KV cache sized by vLLM from "
        f"gpu_memory_utilization={fraction}{note}"
    )
    return EngineDefaults(seqs, tokens, None, fraction, reason)


def _cpu(device: Device, model: ModelFootprint) -> EngineDefaults:
    workers = max(1, device.workers_per_host)
    cores = max(1, device.cores // workers) if device.cores else 1
    reserve = max(OS_RESERVE_BYTES, int(OS_RESERVE_SHARE * device.total_bytes))
    share = max(0, device.total_bytes - reserve) // workers
    if device.free_bytes > 0:  # what others hold already is not this worker's
        share = min(share, device.free_bytes)
    own = model.weight_bytes + RUNTIME_BYTES
    kv = int(max(0, share - own) * CPU_KV_SHARE)
    seqs = min(CPU_MAX_SEQS, max(CPU_MIN_SEQS, CPU_SEQS_PER_CORE * cores))
    bound = "memory"
    if model.kv_bytes_per_token > 0 and model.max_model_len > 0:
        most = KV_CONTEXTS * seqs * model.max_model_len * model.kv_bytes_per_token
        if kv > most:
            kv, bound = most, f"{KV_CONTEXTS} x {seqs} sequences x {model.max_model_len} tokens"
    if kv < CPU_MIN_KV_BYTES:
        kv, bound = CPU_MIN_KV_BYTES, "the floor: the host's memory is short"
    if model.kv_bytes_per_token > 0:
        fits = kv // model.kv_bytes_per_token // MIN_TOKENS_PER_SEQ
        if fits < seqs:
            seqs = max(CPU_MIN_SEQS, fits // CPU_MIN_SEQS * CPU_MIN_SEQS)
    reason = (
        f"CPU, {device.cores} cores and {_gib(device.total_bytes)} GiB ({_gib(device.free_bytes)} available), "
        f"{workers} engine worker(s) a host: max_num_seqs={seqs} ({cores} cores x {CPU_SEQS_PER_CORE}, "
        f"at most {CPU_MAX_SEQS}), max_num_batched_tokens={CPU_BATCHED_TOKENS} (vLLM-CPU's offline "
        f"default); KV cache {_gib(kv)} GiB, bound by {bound} ({_gib(reserve)} GiB kept for the OS "
        f"and other processes, {_gib(own)} GiB for weights and runtime, {CPU_KV_SHARE:.0%} of the rest)"
    )
    return EngineDefaults(seqs, CPU_BATCHED_TOKENS, kv, None, reason)


def _gib(n: int | float) -> str:
    return f"{n / GIB:.2f}"
