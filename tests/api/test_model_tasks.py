"""A model's task in the registry: found from the checkpoint's architecture or given, stored, listed
by `/v1/models`; an embedding model is never quantized by Freight; a batch for an endpoint no model
of the deployment serves is refused at create. On both databases."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from api.app import create_app
from api.services.tenants import create_tenant
from storage.errors import ServiceError
from storage.registry import (
    EMBED,
    GENERATE,
    SCORE,
    TRANSCRIBE,
    embedding_names,
    lookup,
    score_names,
    speech_names,
    task_of,
)
from storage.runtime import Runtime
from tests.conftest import DEMO_MODEL, now
from tests.factories import chat_line, embedding_line, http_create, http_upload
from workers import registration
from workers.registration import AddRequest


def _quiet(_: str) -> None:
    pass


@pytest.mark.parametrize(
    ("architectures", "task"),
    [
        (["LlamaModel"], EMBED),
        (["BertModel"], EMBED),
        (["XLMRobertaModel"], EMBED),
        (["Qwen3ForEmbedding"], EMBED),
        (["LlamaForCausalLM"], GENERATE),
        (["WhisperForConditionalGeneration"], TRANSCRIBE),
        (["BertForSequenceClassification"], GENERATE),
        ([], GENERATE),
        (None, GENERATE),
    ],
)
def test_the_task_a_checkpoint_config_declares(architectures, task) -> None:
    assert task_of({"architectures": architectures}) == task


def test_a_sequence_classifier_with_one_label_is_a_cross_encoder() -> None:
    """What vLLM runs as a cross-encoder (its "classify" task with one logit) scores; a classifier
    of several labels is not a scorer."""
    for arch in ("BertForSequenceClassification", "LlamaForSequenceClassification"):
        assert task_of({"architectures": [arch], "num_labels": 1}) == SCORE
        assert task_of({"architectures": [arch], "id2label": {"0": "LABEL_0"}}) == SCORE
        assert task_of({"architectures": [arch], "id2label": {"0": "no", "1": "yes"}}) == GENERATE
    assert task_of({"architectures": ["LlamaForCausalLM"], "num_labels": 1}) == GENERATE


def test_a_cross_encoder_is_registered_unquantized_and_scores(
    runtime, score_model: Path, embed_model: Path
) -> None:
    """The demo cross-encoder's task is found from its architecture; /v1/score and /v1/rerank are
    served by it or by an embedding model, and refused at create while neither is registered."""
    _, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    line = {"custom_id": "s1", "method": "POST", "url": "/v1/rerank",
            "body": {"model": "rank", "query": "q", "documents": ["a", "b"]}}  # fmt: skip
    rerank_file = http_upload(client, headers, [line]).get_json()["id"]
    for endpoint in ("/v1/score", "/v1/rerank"):
        message = _refused_endpoint(http_create(client, headers, rerank_file, endpoint=endpoint), endpoint)
        assert "cross-encoder or an embedding model" in message and "--task score" in message
    rank = registration.add(runtime, AddRequest("rank", str(score_model)), echo=_quiet)
    assert (rank.task, rank.quantization, rank.requested_quantization) == (SCORE, "none", "none")
    assert score_names(runtime.db, runtime.settings) == {"rank"}
    made = http_create(client, headers, rerank_file, endpoint="/v1/rerank")
    assert made.status_code == 200 and made.get_json()["status"] == "validating", made.get_json()
    listed = client.get("/v1/models", headers=headers).get_json()
    assert {m["id"]: m["x_freight"]["task"] for m in listed["data"]} == {"demo": "generate", "rank": "score"}

    # without the cross-encoder, an embedding model serves them (by the cosine of its vectors)
    from api.services.models import remove

    remove(runtime, "rank")
    assert _refused_endpoint(http_create(client, headers, rerank_file, endpoint="/v1/score"), "/v1/score")
    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=_quiet)
    assert http_create(client, headers, rerank_file, endpoint="/v1/score").status_code == 200


def test_audio_batches_need_a_speech_model(runtime, whisper_model: Path) -> None:
    """Audio batches are refused at create while no speech model is served, naming why; the demo
    Whisper's task ("transcribe") is found from its architecture, it is served as it is, and both
    audio endpoints are then taken."""
    _, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    file_id = http_upload(client, headers, [chat_line("c1")]).get_json()["id"]
    endpoints = ("/v1/audio/transcriptions", "/v1/audio/translations")
    for endpoint in endpoints:
        for dry_run in (False, True):
            response = http_create(client, headers, file_id, endpoint=endpoint, dry_run=dry_run)
            assert "none of its models (demo) is a speech model" in _refused_endpoint(response, endpoint)
    whisper = registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=_quiet)
    assert (whisper.task, whisper.quantization) == (TRANSCRIBE, "none")
    assert whisper.requested_quantization == "none"
    assert speech_names(runtime.db, runtime.settings) == {"whisper"}
    for endpoint in endpoints:
        made = http_create(client, headers, file_id, endpoint=endpoint)
        assert made.status_code == 200 and made.get_json()["status"] == "validating", made.get_json()
    listed = client.get("/v1/models", headers=headers).get_json()
    tasks = {m["id"]: m["x_freight"]["task"] for m in listed["data"]}
    assert tasks == {"demo": "generate", "whisper": "transcribe"}


def test_tasks_are_found_given_stored_and_served(runtime, embed_model: Path) -> None:
    embed = registration.add(runtime, AddRequest("emb", str(embed_model)), echo=_quiet)
    # `auto` quantization on an embedding model: served as it is (the INT4 probe measures generation)
    assert (embed.task, embed.quantization, embed.requested_quantization) == (EMBED, "none", "none")
    forced = registration.add(
        runtime, AddRequest("demo-as-embed", str(DEMO_MODEL), "none", task="embed"), echo=_quiet
    )
    assert forced.task == EMBED
    plain = registration.add(runtime, AddRequest("chat", str(DEMO_MODEL), "none"), echo=_quiet)
    assert plain.task == GENERATE
    assert lookup(runtime.db, runtime.settings, "demo").task == GENERATE  # declared (FREIGHT_MODELS)
    assert embedding_names(runtime.db, runtime.settings) == {"emb", "demo-as-embed"}

    from api.app import create_app
    from api.services.tenants import create_tenant
    from tests.conftest import now

    _, key = create_tenant(runtime.db, "alpha", now())
    client = create_app(runtime=runtime).test_client()
    listed = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).get_json()
    assert {m["id"]: m["x_freight"]["task"] for m in listed["data"]} == {
        "chat": "generate", "demo": "generate", "demo-as-embed": "embed", "emb": "embed"
    }  # fmt: skip


def test_an_embedding_model_is_not_quantized_and_a_task_is_checked(runtime, embed_model: Path) -> None:
    with pytest.raises(ServiceError, match="--quantization w4a16 is for text-generation models"):
        registration.add(runtime, AddRequest("emb", str(embed_model), "w4a16"), echo=_quiet)
    with pytest.raises(ServiceError, match="unsupported task 'rerank'"):
        registration.add(runtime, AddRequest("emb", str(embed_model), task="rerank"), echo=_quiet)
    assert lookup(runtime.db, runtime.settings, "emb") is None


def test_the_cli_shows_the_task(runtime, embed_model: Path) -> None:
    from click.testing import CliRunner

    from api.cli import main

    env = {"FREIGHT_DATABASE_URL": runtime.settings.database_url, "FREIGHT_MODELS": f"demo={DEMO_MODEL}",
           "FREIGHT_DATA_DIR": str(runtime.settings.data_dir)}  # fmt: skip
    runner = CliRunner()
    added = runner.invoke(main, ["models", "add", "emb", "--path", str(embed_model)], env=env)
    assert added.exit_code == 0, added.output
    assert "registered emb: none from" in added.output and "it serves /v1/embeddings" in added.output
    listed = runner.invoke(main, ["models", "list", "--json"], env=env)
    assert {m["name"]: m["task"] for m in map(json.loads, listed.output.splitlines())} == {
        "demo": "generate", "emb": "embed"
    }  # fmt: skip
    table = runner.invoke(main, ["models", "list"], env=env).output.splitlines()
    # TASK and TUNED before ENGINE ARGS, the one column whose cells hold spaces, last
    assert table[0].split()[-4:] == ["TASK", "TUNED", "ENGINE", "ARGS"], table
    assert table[2].split()[-3:] == ["embed", "-", "-"], table


def _refused_endpoint(response, endpoint: str) -> str:
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert (error["param"], error["code"]) == ("endpoint", "endpoint_not_served"), error
    assert f"no model of this deployment serves {endpoint}" in error["message"]
    return error["message"]


def test_an_endpoint_no_model_serves_is_refused_at_create(runtime, embed_model: Path) -> None:
    """Which model a line names is known once the file is read; whether any model of the deployment
    serves the endpoint at all is known at create, and a batch none could run is refused there (and
    its dry run: the same check)."""
    _, key = create_tenant(runtime.db, "alpha", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    embed_file = http_upload(client, headers, [embedding_line("e1", model="emb")]).get_json()["id"]
    message = _refused_endpoint(
        http_create(client, headers, embed_file, endpoint="/v1/embeddings"), "/v1/embeddings"
    )
    assert "its models (demo) generate text" in message and "--task embed" in message
    # both codes create can answer for an endpoint are the ones its OpenAPI 400 describes
    bogus = http_create(client, headers, embed_file, endpoint="/v1/bogus").get_json()["error"]
    documented = client.get("/openapi.json").get_json()["paths"]["/v1/batches"]["post"]["responses"]
    for code in (bogus["code"], "endpoint_not_served"):
        assert f"`{code}`" in documented["400"]["description"], (code, documented["400"])
    dry = http_create(client, headers, embed_file, endpoint="/v1/embeddings", dry_run=True)
    _refused_endpoint(dry, "/v1/embeddings")
    assert client.get("/v1/batches", headers=headers).get_json()["data"] == []

    registration.add(runtime, AddRequest("emb", str(embed_model)), echo=_quiet)
    made = http_create(client, headers, embed_file, endpoint="/v1/embeddings")
    assert made.status_code == 200 and made.get_json()["status"] == "validating", made.get_json()
    chat_file = http_upload(client, headers, [chat_line("c1")]).get_json()["id"]
    assert http_create(client, headers, chat_file).status_code == 200  # demo still serves chat

    # a deployment of embedding models only: the text endpoints are refused, naming its models
    only_embed = Runtime(replace(runtime.settings, models={}))
    try:
        client = create_app(runtime=only_embed).test_client()
        for endpoint in ("/v1/chat/completions", "/v1/completions"):
            message = _refused_endpoint(http_create(client, headers, chat_file, endpoint=endpoint), endpoint)
            assert "its models (emb) are embedding models" in message
        assert http_create(client, headers, embed_file, endpoint="/v1/embeddings").status_code == 200
    finally:
        only_embed.db.dispose()
