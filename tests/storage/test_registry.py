"""The model registry: what a checkpoint's config says about its weights, and rows over declarations."""

from __future__ import annotations

import pytest

from storage import registry
from storage.models import Model
from storage.registry import RegistryError, entries, lookup, quantization_of, require, served_names
from tests.conftest import DEMO_MODEL


def _ct(bits: int, activations: object = None) -> dict:
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "g": {"weights": {"num_bits": bits, "type": "int"}, "input_activations": activations}
            },
        }
    }


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, "none"),
        ({"quantization_config": None}, "none"),
        (_ct(4), "w4a16"),
        (_ct(8), "other"),
        (_ct(4, {"num_bits": 8}), "other"),  # W4A8 is not weight-only
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq"),
        ({"quantization_config": {"quant_method": "AWQ"}}, "awq"),
        ({"quantization_config": {"quant_method": "fp8"}}, "other"),
    ],
)
def test_quantization_of_reads_the_config(config: dict, expected: str) -> None:
    assert quantization_of(config) == expected


def _row(name: str, **extra: object) -> Model:
    values: dict = {
        "name": name,
        "source": "/srv/m",
        "checkpoint": "/srv/m-int4",
        "requested_quantization": "w4a16",
        "quantization": "w4a16",
        "created_at": 1,
    }
    return Model(**(values | extra))


def test_rows_and_declared_models_make_one_listing(runtime) -> None:
    rt = runtime
    with rt.db.write() as s:
        s.add(_row("alpha", list_price_input=1.0, list_price_output=2.0, instance_price_per_hour=0.5))
    names = [e.name for e in entries(rt.db, rt.settings)]
    assert names == ["alpha", "demo"]  # the row, and FREIGHT_MODELS' demo
    demo = lookup(rt.db, rt.settings, "demo")
    assert demo is not None and demo.declared and demo.checkpoint == str(DEMO_MODEL)
    assert demo.quantization == "none"
    alpha = require(rt.db, rt.settings, "alpha")
    assert not alpha.declared and alpha.checkpoint == "/srv/m-int4"
    assert alpha.price_per_hour(rt.settings) == 0.5
    price = alpha.list_price_or_default(rt.settings)
    assert price is not None and (price.input, price.cached_input, price.output) == (1.0, 1.0, 2.0)
    assert served_names(rt.db, rt.settings) == {"alpha", "demo"}


def test_a_row_overrides_a_declaration_of_the_same_name(runtime) -> None:
    with runtime.db.write() as s:
        s.add(_row("demo", instance_price_per_hour=2.0))
    (demo,) = entries(runtime.db, runtime.settings)
    assert not demo.declared and demo.checkpoint == "/srv/m-int4"
    assert demo.price_per_hour(runtime.settings) == 2.0


def test_an_unknown_model_is_named_with_what_is_served(runtime) -> None:
    assert lookup(runtime.db, runtime.settings, "nope") is None
    with pytest.raises(RegistryError, match=r"'nope' is not registered \(served: demo\)"):
        require(runtime.db, runtime.settings, "nope")


def test_one_catalog_read_answers_what_each_question_answers(runtime) -> None:
    """Validation reads the registry once (``catalog``): the same answers as asking each question."""
    rt = runtime
    with rt.db.write() as s:
        s.add(_row("chat", tool_call_parser="hermes", engine_args={"reasoning_parser": "qwen3"}))
        s.add(_row("vec", task="embed"))
        s.add(_row("rank", task="score"))
        s.add(_row("ears", task="transcribe"))
    models = registry.catalog(rt.db, rt.settings)
    assert models.names() == served_names(rt.db, rt.settings) == {"chat", "vec", "rank", "ears", "demo"}
    assert models.names(registry.EMBED) == registry.embedding_names(rt.db, rt.settings) == {"vec"}
    assert models.names(registry.SCORE) == registry.score_names(rt.db, rt.settings) == {"rank"}
    assert models.names(registry.TRANSCRIBE) == registry.speech_names(rt.db, rt.settings) == {"ears"}
    assert models.auto_tool == registry.auto_tool_models(rt.db) == {"chat"}
    assert models.reasoning == registry.reasoning_models(rt.db) == {"chat"}
    assert models.get("demo") == lookup(rt.db, rt.settings, "demo")
    assert models.get("chat") == lookup(rt.db, rt.settings, "chat")
    assert models.get("nope") is None
