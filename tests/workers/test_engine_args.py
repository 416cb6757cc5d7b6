"""A model's vLLM engine arguments: parsed as `vllm serve` parses them, refused with a one-line
reason naming the field, laid over the FREIGHT_ENGINE_* defaults, and read back from a running
engine's own configuration (one real engine of the demo model, eager)."""

from __future__ import annotations

import pytest

from storage.settings import Settings
from workers.bootstrap import engine_config
from workers.engine_args import OWNED, EngineArgError, describe, parse_assignments


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (["tensor_parallel_size=2"], {"tensor_parallel_size": 2}),
        (["--pipeline-parallel-size=2"], {"pipeline_parallel_size": 2}),  # the CLI's spelling
        (["gpu_memory_utilization=0.85"], {"gpu_memory_utilization": 0.85}),
        (["max_num_batched_tokens=8k"], {"max_num_batched_tokens": 8000}),  # vLLM's sizes
        (["max_num_batched_tokens=2K"], {"max_num_batched_tokens": 2048}),
        (["kv_cache_dtype=fp8"], {"kv_cache_dtype": "fp8"}),
        (["enable_chunked_prefill=false"], {"enable_chunked_prefill": False}),
        (["enable_chunked_prefill"], {"enable_chunked_prefill": True}),  # a flag given alone
        (["enforce_eager=yes"], {"enforce_eager": True}),
        (["max_model_len=4096"], {"max_model_len": 4096}),
        (
            ['speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'],
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}},
        ),
        (['compilation_config={"mode": 0}'], {"compilation_config": {"mode": 0}}),
    ],
)
def test_values_parse_as_vllm_serve_parses_them(texts: list[str], expected: dict) -> None:
    assert parse_assignments(texts) == expected


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (
            ["tensor_paralel_size=2"],
            "unknown engine arg 'tensor_paralel_size': vLLM .* has no such field "
            r"\(did you mean tensor_parallel_size\?\)",
        ),
        (["tensor_parallel_size=two"], r"bad value for engine arg 'tensor_parallel_size': .*two"),
        (["gpu_memory_utilization=most"], "bad value for engine arg 'gpu_memory_utilization'"),
        (["kv_cache_dtype=fp7"], r"bad value for engine arg 'kv_cache_dtype': 'fp7' is not one of .*fp8"),
        (["enable_chunked_prefill=maybe"], "'maybe' is not true or false"),
        (["speculative_config={not json"], "bad value for engine arg 'speculative_config'"),
        (["tensor_parallel_size"], r"engine arg 'tensor_parallel_size' needs a value"),
        (["=2"], "give KEY=VALUE"),
        (["max_num_seqs=8", "max-num-seqs=9"], "'max_num_seqs' is given twice"),
    ],
)
def test_bad_engine_args_are_one_line_naming_the_field(texts: list[str], message: str) -> None:
    with pytest.raises(EngineArgError, match=message) as caught:
        parse_assignments(texts)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("field", sorted(OWNED))
def test_freights_own_fields_are_refused_with_the_reason(field: str) -> None:
    with pytest.raises(EngineArgError, match=f"engine arg '{field}' is Freight's: ") as caught:
        parse_assignments([f"{field}=1"])
    assert OWNED[field] in str(caught.value)


def test_describe_is_stable_and_plain() -> None:
    args = {"max_num_seqs": 8, "enforce_eager": True, "speculative_config": {"method": "ngram"}}
    assert describe(args) == 'enforce_eager=true max_num_seqs=8 speculative_config={"method":"ngram"}'


def test_a_models_args_override_the_deployment_defaults() -> None:
    s = Settings.from_env({"FREIGHT_ENGINE_MAX_NUM_SEQS": "64", "FREIGHT_ENGINE_KV_CACHE_GIB": "2",
                           "FREIGHT_ENGINE_MAX_MODEL_LEN": "1024", "FREIGHT_ENGINE_DTYPE": "float32"})  # fmt: skip
    plain = engine_config(s, "m", "/models/m")
    assert (plain.max_num_seqs, plain.kv_cache_bytes, plain.max_model_len, plain.dtype) == (
        64, 2 * 1024**3, 1024, "float32"
    )  # fmt: skip
    assert plain.engine_args == {}
    own = engine_config(
        s, "m", "/models/m", 512,
        {"max_num_seqs": 8, "kv_cache_memory_bytes": 10**8, "dtype": "bfloat16", "tensor_parallel_size": 2,
         "kv_cache_dtype": "fp8"},
    )  # fmt: skip
    assert (own.max_num_seqs, own.kv_cache_bytes, own.max_model_len, own.dtype) == (8, 10**8, 512, "bfloat16")
    assert own.engine_args == {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"}  # passed to vLLM as given
    # a model sized by gpu_memory_utilization is not also given FREIGHT_ENGINE_KV_CACHE_GIB
    util = engine_config(s, "m", "/models/m", None, {"gpu_memory_utilization": 0.8})
    assert util.kv_cache_bytes is None and util.engine_args == {"gpu_memory_utilization": 0.8}


def test_structured_outputs_are_compact_json_unless_the_model_says_otherwise() -> None:
    from workers.engine import STRUCTURED_OUTPUTS, EngineConfig, engine_arguments

    chat = engine_arguments(EngineConfig(model_path="/m", served_name="m"), None, False)
    assert chat["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    embed = engine_arguments(EngineConfig(model_path="/m", served_name="m", task="embed"), None, False)
    assert "structured_outputs_config" not in embed  # a pooling model writes no text
    own = parse_assignments(
        ['structured_outputs_config={"backend": "guidance", "disable_any_whitespace": true}']
    )
    chosen = engine_arguments(EngineConfig(model_path="/m", served_name="m", engine_args=own), None, False)
    assert chosen["structured_outputs_config"] == {"backend": "guidance", "disable_any_whitespace": True}
    assert STRUCTURED_OUTPUTS["backend"] == "xgrammar"  # the default was copied, not shared
    chat["structured_outputs_config"]["backend"] = "x"
    assert STRUCTURED_OUTPUTS["backend"] == "xgrammar"


def test_a_models_args_reach_the_running_engine(demo_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered values, through engine_config, read back from the started engine's vLLM config."""
    from workers.engine import Engine

    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    s = Settings.from_env({"FREIGHT_ENGINE_ENFORCE_EAGER": "true", "FREIGHT_ENGINE_KV_CACHE_GIB": "0.03125",
                           "FREIGHT_ENGINE_MAX_NUM_SEQS": "16"})  # fmt: skip
    args = parse_assignments(["max_num_batched_tokens=1536", "max_num_seqs=6", "block_size=32"])
    engine = Engine.start(engine_config(s, "demo", str(demo_model_dir), 768, args))
    try:
        config = engine.vllm_config
        assert config.scheduler_config.max_num_batched_tokens == 1536
        assert config.scheduler_config.max_num_seqs == 6
        assert config.cache_config.block_size == 32
        assert config.model_config.max_model_len == 768 == engine.max_model_len
        assert engine.window == 12  # Freight's feed follows the model's max_num_seqs, not the default
    finally:
        engine.shutdown()
