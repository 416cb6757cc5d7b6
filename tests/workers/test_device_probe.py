"""workers/device_probe.py and the engine's sizes as a worker resolves them (workers/bootstrap.py:
engine_sizes): the model's engine args over the operator's FREIGHT_ENGINE_* over the device's
defaults (scheduler/engine_defaults.py), the GPU table checked against the installed vLLM's own,
and one real engine started on the demo model with nothing set."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler import engine_defaults as ed
from scheduler.engine_defaults import GIB, Device, engine_defaults
from storage.settings import Settings
from workers import bootstrap
from workers.bootstrap import engine_config
from workers.device_probe import cpu_device, model_footprint, probe_device
from workers.engine import native_half_precision

SMALL_CPU = Device(kind="cpu", name="cpu", total_bytes=8 * GIB, free_bytes=6 * GIB, cores=2)
H100 = Device(
    kind="gpu", name="NVIDIA H100 80GB HBM3", total_bytes=int(79.2 * GIB), free_bytes=int(78.6 * GIB)
)
SHARED_L4 = Device(kind="gpu", name="NVIDIA L4", total_bytes=22 * GIB, free_bytes=11 * GIB)


def test_cpu_device_reads_meminfo_and_this_processs_cores(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24684504 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    )
    device = cpu_device(workers_per_host=3, meminfo=meminfo)
    assert (device.kind, device.total_bytes, device.free_bytes) == ("cpu", 24684504 * 1024, 20000000 * 1024)
    assert device.cores == len(os.sched_getaffinity(0)) and device.workers_per_host == 3
    missing = cpu_device(meminfo=tmp_path / "none")  # unreadable: zeros, and the decision's floor
    assert missing.total_bytes == 0 and engine_defaults(missing).kv_cache_bytes == ed.CPU_MIN_KV_BYTES


def test_this_machine_is_probed_as_a_cpu_host() -> None:
    device = probe_device()  # torch here is a CPU build: no GPU
    assert device.kind == "cpu" and device.total_bytes > device.free_bytes > 0 and device.cores >= 1


def test_the_demo_models_footprint_is_read_from_its_checkpoint(demo_model_dir: Path) -> None:
    footprint = model_footprint(str(demo_model_dir), None, "bfloat16")
    # 4 layers x 2 KV heads x 64 dims x K and V x 2 bytes; config.json's max_position_embeddings
    assert footprint.kv_bytes_per_token == 2048 and footprint.max_model_len == 2048
    assert 5 * 10**6 < footprint.weight_bytes < 20 * 10**6
    assert model_footprint(str(demo_model_dir), 768, "float32").kv_bytes_per_token == 4096
    assert model_footprint("/no/such/model", None, "auto") == ed.ModelFootprint()


@pytest.mark.parametrize(
    ("name", "gib"),
    [("NVIDIA H100 80GB HBM3", 79.2), ("NVIDIA A100-SXM4-80GB", 79.2), ("NVIDIA A10", 22.1),
     ("NVIDIA L4", 22.0), ("NVIDIA B200", 178.4), ("cpu", 512.0)],
)  # fmt: skip
def test_the_device_table_is_the_installed_vllms_offline_defaults(
    name: str, gib: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's EngineArgs.get_batch_defaults on a described platform (a stand-in for vLLM's
    current_platform: no GPU here), usage context LLM_CLASS, against Freight's decision."""
    import vllm.engine.arg_utils as arg_utils
    from vllm.config.cache import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    is_cpu = name == "cpu"
    platform = SimpleNamespace(
        get_device_total_memory=lambda device_id=0: int(gib * GIB),
        get_device_name=lambda device_id=0: name,
        is_tpu=lambda: False,
        is_cpu=lambda: is_cpu,
    )
    monkeypatch.setattr(arg_utils, "current_platform", platform)
    tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
    device = Device(kind="cpu" if is_cpu else "gpu", name=name, total_bytes=int(gib * GIB), cores=256)
    chosen = engine_defaults(device)
    assert chosen.max_num_batched_tokens == tokens[UsageContext.LLM_CLASS]
    if is_cpu:  # vLLM-CPU's 256 sequences, reached with 4 cores or more
        assert chosen.max_num_seqs == seqs[UsageContext.LLM_CLASS] == ed.CPU_MAX_SEQS
    else:
        assert chosen.max_num_seqs == seqs[UsageContext.LLM_CLASS]
        assert chosen.gpu_memory_utilization == CacheConfig().gpu_memory_utilization


def settings(**env: str) -> Settings:
    return Settings.from_env({f"FREIGHT_ENGINE_{k.upper()}": v for k, v in env.items()})


def test_nothing_set_takes_the_devices_sizes_and_says_why(demo_model_dir: Path) -> None:
    config = engine_config(settings(), "demo", str(demo_model_dir), device=SMALL_CPU)
    # bound by two full batches of full contexts (ed.KV_CONTEXTS): 1 GiB of the 16-bit demo model's
    # cache, twice that where it is served in float32 (no native half precision: AVX2 hosts)
    kv = GIB if native_half_precision() else 2 * GIB
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_bytes) == (128, 4096, kv)
    assert config.sizing.startswith("max_num_seqs, max_num_batched_tokens, kv_cache_bytes by the device: CPU")
    assert "engine_args" not in config.sizing and config.engine_args == {}


def test_the_operators_settings_win_over_the_device_and_the_models_args_over_both(
    demo_model_dir: Path,
) -> None:
    path = str(demo_model_dir)
    mine = settings(max_num_seqs="32", kv_cache_gib="0.5")
    config = engine_config(mine, "demo", path, device=SMALL_CPU)
    assert (config.max_num_seqs, config.kv_cache_bytes, config.max_num_batched_tokens) == (32, GIB // 2, 4096)
    assert "max_num_seqs=32 (FREIGHT_ENGINE_MAX_NUM_SEQS)" in config.sizing
    assert "max_num_batched_tokens by the device" in config.sizing
    model = {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": 10**8}
    own = engine_config(mine, "demo", path, engine_args=model, device=SMALL_CPU)
    assert (own.max_num_seqs, own.max_num_batched_tokens, own.kv_cache_bytes) == (8, 1024, 10**8)
    assert "by the device" not in own.sizing and "max_num_seqs=8 (the model's engine args)" in own.sizing


def test_every_size_given_probes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(*_: object) -> Device:
        raise AssertionError("probed although every size was given")

    monkeypatch.setattr("workers.device_probe.probe_device", no_probe)
    given = settings(max_num_seqs="16", max_num_batched_tokens="2048", kv_cache_gib="1")
    config = engine_config(given, "m", "/models/m")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_bytes) == (16, 2048, GIB)


def test_a_gpu_leaves_the_cache_to_vllms_memory_fraction() -> None:
    config = engine_config(settings(), "m", "/models/m", device=H100)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.kv_cache_bytes) == (1024, 16384, None)
    assert config.engine_args == {}  # vLLM's own 0.92 needs no saying
    shared = engine_config(settings(), "m", "/models/m", device=SHARED_L4)
    assert (shared.max_num_seqs, shared.max_num_batched_tokens) == (256, 8192)
    assert shared.engine_args == {"gpu_memory_utilization": pytest.approx(0.48)}
    # the model's own fraction wins, and an operator's byte size still replaces the fraction
    own = engine_config(
        settings(), "m", "/models/m", engine_args={"gpu_memory_utilization": 0.7}, device=SHARED_L4
    )
    assert own.engine_args == {"gpu_memory_utilization": 0.7} and own.kv_cache_bytes is None
    sized = engine_config(settings(kv_cache_gib="40"), "m", "/models/m", device=H100)
    assert sized.kv_cache_bytes == 40 * GIB and sized.engine_args == {}


def test_a_real_engine_starts_on_the_devices_sizes(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo model with no size set, on this machine: the started vLLM runs what was chosen."""
    from workers.engine import Engine

    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    expected = engine_defaults(probe_device(), model_footprint(str(demo_model_dir), None, "auto"))
    config = engine_config(settings(enforce_eager="true"), "demo", str(demo_model_dir))
    assert "by the device: CPU" in config.sizing
    engine = Engine.start(config)
    try:
        scheduler = engine.vllm_config.scheduler_config
        assert scheduler.max_num_seqs == config.max_num_seqs == expected.max_num_seqs
        assert scheduler.max_num_batched_tokens == config.max_num_batched_tokens == 4096
        assert engine.vllm_config.cache_config.kv_cache_memory_bytes == config.kv_cache_bytes
        assert config.kv_cache_bytes == expected.kv_cache_bytes
    finally:
        engine.shutdown()


def test_bootstrap_logs_the_sizes_it_chose(demo_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger=bootstrap.__name__):
        engine_config(settings(), "demo", str(demo_model_dir), device=SMALL_CPU)
    assert any(
        "engine sizes for demo: " in r.getMessage() and "by the device" in r.getMessage()
        for r in caplog.records
    )


def test_a_gpu_is_described_as_vllms_platform_sees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: vLLM's platform is described (an H100 behind CUDA_VISIBLE_DEVICES), and the
    probe must hand its name, memory and capability to the decision unchanged."""
    import vllm.platforms

    from workers import device_probe

    fake = SimpleNamespace(
        is_cuda_alike=lambda: True,
        get_device_total_memory=lambda device_id=0: 85_520_809_984,  # an H100 80GB HBM3's
        get_device_name=lambda device_id=0: "NVIDIA H100 80GB HBM3",
        get_device_capability=lambda device_id=0: SimpleNamespace(major=9, minor=0),
    )
    monkeypatch.setattr(vllm.platforms, "current_platform", fake)
    monkeypatch.setattr(device_probe, "_gpu_free_bytes", lambda platform: 84_000_000_000)
    device = probe_device()
    assert (device.kind, device.name, device.total_bytes, device.free_bytes) == (
        "gpu", "NVIDIA H100 80GB HBM3", 85_520_809_984, 84_000_000_000
    )  # fmt: skip
    assert device.compute_capability == (9, 0)
    assert (engine_defaults(device).max_num_seqs, engine_defaults(device).max_num_batched_tokens) == (
        1024,
        16384,
    )

    def unreachable(platform: object) -> int:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(device_probe, "_gpu_free_bytes", unreachable)
    blind = probe_device()  # still a GPU host: sized as vLLM's smaller GPUs, vLLM's start says the rest
    assert blind.kind == "gpu" and blind.total_bytes == 0
    assert engine_defaults(blind).max_num_seqs == 256
