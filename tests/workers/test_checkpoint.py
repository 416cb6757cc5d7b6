"""Checkpoint facts for metering, read from safetensors headers and config.json."""

import json
import struct
from pathlib import Path

from workers.checkpoint import model_shape, stored_dtype


def write_safetensors(path: Path, tensors: dict) -> None:
    header = json.dumps(tensors).encode()
    size = max((t["data_offsets"][1] for t in tensors.values() if "data_offsets" in t), default=0)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * size)


def test_demo_model_shape(demo_model):
    shape = model_shape(demo_model)
    assert shape is not None
    config = json.loads((demo_model / "config.json").read_text())
    h, inter, layers, vocab = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h  # attention, MLP, two norms
    assert shape.parameters == layers * per_layer + 2 * vocab * h + h  # embeddings, head, final norm
    assert shape.bytes_per_parameter == 2.0  # bf16
    assert shape.kv_bytes_per_token == 2 * layers * kv * 2


def test_packed_int4_weights_count_eight_per_int32(tmp_path):
    write_safetensors(
        tmp_path / "model.safetensors",
        {
            "layer.weight_packed": {"dtype": "I32", "shape": [64, 16], "data_offsets": [0, 4096]},
            "layer.weight_scale": {"dtype": "BF16", "shape": [64, 1], "data_offsets": [4096, 4224]},
            "__metadata__": {"format": "pt"},
        },
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128, "torch_dtype": "float16"}
        )
    )
    shape = model_shape(tmp_path)
    assert shape is not None
    assert shape.parameters == 64 * 16 * 8 + 64
    assert shape.bytes_per_parameter == (4096 + 128) / (64 * 16 * 8 + 64)
    assert shape.kv_bytes_per_token == 2 * 2 * 4 * 32 * 2  # no KV heads given: one per head


def test_unreadable_checkpoint_gives_none(tmp_path):
    assert model_shape(tmp_path) is None


def test_served_dtype_counts_weights_and_kv_at_its_width(demo_model):
    stored = model_shape(demo_model)
    served = model_shape(demo_model, served_dtype="float32")
    assert stored is not None and served is not None
    assert served.parameters == stored.parameters
    assert served.bytes_per_parameter == 4.0
    assert served.kv_bytes_per_token == 2 * stored.kv_bytes_per_token
    assert model_shape(demo_model, served_dtype="bfloat16") == stored


def test_stored_dtype_and_quantized_checkpoints(tmp_path):
    assert stored_dtype(tmp_path) == (None, False)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert stored_dtype(tmp_path) == ("float16", False)
    write_safetensors(
        tmp_path / "model.safetensors",
        {
            "layer.weight_packed": {"dtype": "I32", "shape": [64, 16], "data_offsets": [0, 4096]},
            "layer.weight_scale": {"dtype": "BF16", "shape": [64, 1], "data_offsets": [4096, 4224]},
        },
    )
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 128,
        "dtype": "bfloat16",
        "quantization_config": {"format": "pack-quantized"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert stored_dtype(tmp_path) == ("bfloat16", True)
    # an INT4 checkpoint's weights stay packed whatever its activations compute in
    assert model_shape(tmp_path, served_dtype="float32") == model_shape(tmp_path)
