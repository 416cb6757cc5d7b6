"""``storage.checkpoint_config``: the one reader of a checkpoint's config.json, multimodal configs'
``text_config`` merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage.checkpoint_config import config_or_empty, merged, read_config
from storage.registry import local_quantization, local_task

MULTIMODAL = {
    "architectures": ["LlavaForConditionalGeneration"],
    "torch_dtype": "float32",
    "quantization_config": {"quant_method": "awq"},
    "vision_config": {"hidden_size": 1024},
    "text_config": {
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "bfloat16",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
    },
}


def _checkpoint(path: Path, config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_plain_config_reads_as_it_is(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float16", "hidden_size": 64}
    assert read_config(_checkpoint(tmp_path, config)) == config


def test_a_multimodal_config_gives_its_language_models_keys(tmp_path: Path) -> None:
    config = read_config(_checkpoint(tmp_path, MULTIMODAL))
    assert config["torch_dtype"] == "bfloat16"  # the text model's, over the outer one
    assert config["hidden_size"] == 4096 and config["num_hidden_layers"] == 32
    # what the whole checkpoint is for and how its files are packed stay the outer model's
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["quantization_config"] == {"quant_method": "awq"}
    assert config["vision_config"] == {"hidden_size": 1024}
    assert "text_config" not in config
    assert merged(config) == config  # merging again changes nothing


def test_an_unreadable_config_is_an_error_to_read_config_and_unknown_to_config_or_empty(
    tmp_path: Path,
) -> None:
    with pytest.raises(OSError):
        read_config(tmp_path)  # no config.json
    assert config_or_empty(tmp_path) == {}
    _checkpoint(tmp_path / "list", ["not", "an", "object"])
    with pytest.raises(ValueError, match="not a JSON object"):
        read_config(tmp_path / "list")
    assert config_or_empty(tmp_path / "list") == {}
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    with pytest.raises(ValueError):
        read_config(tmp_path / "broken")
    assert config_or_empty(str(tmp_path / "broken")) == {}
    assert config_or_empty("s3://bucket/models/llama") == {}  # not fetched to be described


def test_the_registry_reads_a_multimodal_checkpoint_through_it(tmp_path: Path) -> None:
    path = str(_checkpoint(tmp_path, MULTIMODAL))
    assert local_quantization(path) == "awq"
    assert local_task(path) == "generate"  # the outer architecture, not the text model's alone
    assert local_quantization("s3://bucket/x") == "none" and local_task("s3://bucket/x") == "generate"
