"""Which models vLLM keeps a prefix cache for, as Freight predicts it and as its engine starts
(issue #22 s1: predicted cache hits for models that cache nothing).

vLLM caches prefixes for generative decoders and for causal pooling models with LAST pooling; a
bidirectional encoder (BERT) or MEAN/CLS pooling caches nothing. The prediction asks vLLM's own
``ModelConfig`` of real checkpoint folders (configs and tokenizers; no weights are needed, no
engine starts); the engine's arguments are checked against vLLM's engine config built from them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api.services.tenants import create_tenant
from storage.models import WorkUnit
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import embedding_line, validated_batch
from workers import registration
from workers.checkpoint import stored_dtype
from workers.engine import EngineConfig, engine_arguments
from workers.prefix_caching import caches_prefixes
from workers.registration import AddRequest

MEAN = {"pooler_config": {"seq_pooling_type": "MEAN"}}
DOC = "A long document about the shipping of freight by rail, road and sea. " * 16  # ~250 tokens


def bert_checkpoint(folder: Path) -> Path:
    """A BertModel config: a bidirectional encoder, as most sentence embedders are."""
    from transformers import BertConfig

    BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        architectures=["BertModel"],
    ).save_pretrained(folder)  # fmt: skip
    return folder


def mean_pooled_copy(embed_model: Path, folder: Path) -> Path:
    """The demo embedding model's config and tokenizer, declaring sentence-transformers MEAN
    pooling in its own files (modules.json, 1_Pooling/config.json), as such checkpoints do."""
    shutil.copytree(embed_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 256, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False,
    }))  # fmt: skip
    return folder


def test_vllm_caches_decoders_and_last_pooling_but_not_encoders_or_mean_pooling(
    demo_model: Path, embed_model: Path, tmp_path: Path
) -> None:
    assert caches_prefixes(str(demo_model), "generate")
    assert caches_prefixes(str(embed_model), "embed")  # a LlamaModel: causal, LAST by default
    assert not caches_prefixes(str(embed_model), "embed", MEAN)  # the model's engine args
    assert not caches_prefixes(str(embed_model), "embed", {"pooler_config": {"seq_pooling_type": "CLS"}})
    assert not caches_prefixes(str(mean_pooled_copy(embed_model, tmp_path / "st")), "embed")  # its own files
    assert not caches_prefixes(str(bert_checkpoint(tmp_path / "bert")), "embed")
    # engine args that are not the model config's do not change the answer
    assert caches_prefixes(str(embed_model), "embed", {"max_num_seqs": 8, "enforce_eager": True})


def test_a_checkpoint_vllm_cannot_describe_predicts_as_a_caching_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["NoSuchModel"], "model_type": "nope"})
    )
    assert caches_prefixes(str(tmp_path), "generate")


@pytest.mark.parametrize(
    ("task", "args", "cached"),
    [("generate", {}, True), ("embed", {}, True), ("embed", MEAN, False)],
)
def test_the_engine_leaves_prefix_caching_to_vllms_rule(
    demo_model: Path, embed_model: Path, task: str, args: dict, cached: bool
) -> None:
    """Freight's engine arguments turn the prefix cache on where the model supports it, and
    never force it on a model vLLM says would give wrong answers with it; the prediction says
    the same of each."""
    from vllm.engine.arg_utils import EngineArgs

    path = str(demo_model if task == "generate" else embed_model)
    config = EngineConfig(model_path=path, served_name="m", enforce_eager=True, task=task, engine_args=args)
    vllm_config = EngineArgs(**engine_arguments(config, *stored_dtype(path))).create_engine_config()
    assert vllm_config.cache_config.enable_prefix_caching is cached
    assert caches_prefixes(path, task, args) is cached
    off = EngineConfig(model_path=path, served_name="m", enable_prefix_caching=False, task=task)
    assert engine_arguments(off, *stored_dtype(path))["enable_prefix_caching"] is False


def _planned(rt: Runtime, batch_id: str) -> int:
    with rt.db.read() as s:
        return int(
            s.scalar(select(func.sum(WorkUnit.planned_cached_tokens)).where(WorkUnit.batch_id == batch_id))
            or 0
        )


def test_a_batch_on_a_model_that_caches_nothing_plans_no_cache_hits(
    runtime: Runtime, embed_model: Path
) -> None:
    """The same embeddings file, sharing a ~250-token prefix line to line, planned for the demo
    embedding model as it is (LAST pooling: hits predicted) and registered with MEAN pooling
    (none)."""
    quiet = lambda _: None  # noqa: E731
    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=quiet)
    registration.add(
        runtime,
        AddRequest("emb-mean", str(embed_model), engine_args=('pooler_config={"seq_pooling_type": "MEAN"}',)),
        echo=quiet,
    )
    tenant, _ = create_tenant(runtime.db, "t", now())
    planned = {}
    for model in ("emb", "emb-mean"):
        lines = [embedding_line(f"{model}-{i}", f"{DOC} item {i}", model=model) for i in range(8)]
        batch_id = validated_batch(
            runtime, tenant.id, lines, endpoint="/v1/embeddings", name=f"{model}.jsonl"
        )
        planned[model] = _planned(runtime, batch_id)
    assert planned["emb"] >= 7 * 128  # every line after the first: its shared whole blocks
    assert planned["emb-mean"] == 0


def test_registration_keeps_vllms_answer_and_validation_reads_it(runtime: Runtime, embed_model: Path) -> None:
    """vLLM is asked at registration and again when engine args change (a pooler's type changes the
    answer); validation's prediction reads the registry's answer, so it holds even where vLLM
    could not be asked again (the checkpoint's files gone: before, that predicted hits)."""
    from storage.models import Model
    from workers import prefix_caching

    quiet = lambda _: None  # noqa: E731
    assert registration.add(runtime, AddRequest("emb", str(embed_model)), echo=quiet).caches_prefixes is True
    changed = registration.set_engine(runtime, "emb", ['pooler_config={"seq_pooling_type": "MEAN"}'])
    assert changed.caches_prefixes is False
    assert prefix_caching.prediction_block_size(runtime, "emb", 32) == 0
    with runtime.db.write() as s:
        row = s.get(Model, "emb")
        assert row is not None
        row.checkpoint = str(runtime.settings.data_dir / "gone")  # vLLM cannot be asked of this one
    assert prefix_caching.prediction_block_size(runtime, "emb", 32) == 0  # the registry's answer
    with runtime.db.write() as s:
        s.get(Model, "emb").caches_prefixes = None  # type: ignore[union-attr]  # a row made before 0037
    assert prefix_caching.prediction_block_size(runtime, "emb", 32) == 32  # asked of vLLM: no files
