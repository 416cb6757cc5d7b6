"""A dry run's price counts images and audio (workers/media_tokens.py): an image as the demo
vision-language model's processor expands it (the tokens vLLM adds to its prompt: 94 for a square
image, tests/infra/test_build_vlm_model.py's engine run), a transcription line as its decoder
prompt plus 100 log-mel frames a second (224 for 2.2 s in English,
tests/workers/test_transcription_engine.py's engine run). The estimate's task runs in-process,
through Flask's test client, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import io
import json
import uuid
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from api.app import create_app
from api.services.tenants import create_tenant
from infra.build_vlm_model import IMAGE_SEQ_LEN
from tests.audio_factories import TRANSCRIPTIONS, TRANSLATIONS, audio_line, tone
from tests.conftest import now
from tests.factories import chat_line, data_url, http_create, http_upload, image_bytes, image_line
from workers import estimates, intake, registration
from workers.images import ImageRefused
from workers.media_tokens import MediaCounter, SpeechTokens, header_seconds, header_size, image_tokens_for
from workers.prompt_tokens import renderer_for
from workers.registration import AddRequest

# what vLLM's engine adds to a prompt for an image on the demo Idefics3 (measured by
# tests/infra/test_build_vlm_model.py): 2 x 2 tiles and the global one of IMAGE_SEQ_LEN, 14 markers
SQUARE_IMAGE_TOKENS = 5 * IMAGE_SEQ_LEN + 14
WIDE_IMAGE_TOKENS = 3 * IMAGE_SEQ_LEN + 9  # 2:1: 1 x 2 tiles and the global one
QUESTION = "What is in this image?"


@pytest.fixture
def settings(settings):
    """Room for a few seconds of audio in a file."""
    return dataclasses.replace(settings, max_file_bytes=4 * 1024 * 1024)


def _estimate(
    runtime, lines: list[dict] | bytes, endpoint: str = "/v1/chat/completions", key: str | None = None
) -> dict:
    """The dry run of ``lines`` by a new tenant (or the one of API key ``key``), its task run here:
    the answer's estimate."""
    if key is None:
        _, key = create_tenant(runtime.db, f"t-{uuid.uuid4().hex[:12]}", now())
    headers = {"Authorization": f"Bearer {key}"}
    client = create_app(runtime=runtime).test_client()
    file_id = http_upload(client, headers, lines, "media.jsonl").get_json()["id"]
    made = http_create(client, headers, file_id, endpoint=endpoint, dry_run=True)
    assert made.status_code == 200, made.get_data(as_text=True)
    estimates.run(runtime, made.get_json()["id"])
    answer = client.get(f"/v1/batches/{made.get_json()['id']}", headers=headers).get_json()
    assert answer["status"] == "completed", answer
    document = client.get("/openapi.json").get_json()  # the media block is in the published schema
    schema = Draft202012Validator({**document, "$ref": "#/components/schemas/Estimate"})
    assert not list(schema.iter_errors(answer)), list(schema.iter_errors(answer))[:1]
    return answer["estimate"]


def test_an_image_costs_what_the_models_processor_expands_it_to(vlm_model: Path) -> None:
    counter = image_tokens_for(str(vlm_model), {})
    assert counter is image_tokens_for(str(vlm_model), {})  # made once per process
    assert counter.tokens(64, 64) == counter.tokens(1000, 1000) == SQUARE_IMAGE_TOKENS  # not by size
    assert counter.tokens(48, 24) == WIDE_IMAGE_TOKENS
    assert counter.largest() >= SQUARE_IMAGE_TOKENS
    assert header_size(image_bytes(40, 30), 10_000) == (40, 30)  # from the header
    with pytest.raises(ImageRefused):  # past the pixel limit: the batch would refuse it
        header_size(image_bytes(40, 30), 1_000)


def test_audio_costs_its_decoder_prompt_and_100_frames_a_second(whisper_model: Path) -> None:
    speech = SpeechTokens.load(str(whisper_model), renderer_for(str(whisper_model), 2048).tokenizer)
    assert header_seconds(tone(2.2), 30.0) == pytest.approx(2.2)
    english = {"model": "whisper", "language": "en"}
    # the engine's usage for this line (test_transcription_engine): 4 + 220
    assert speech.prompt_tokens(TRANSCRIPTIONS, english) + speech.audio_tokens(2.2) == 4 + 220
    assert speech.prompt_tokens(TRANSLATIONS, {"model": "whisper"}) == 4  # the detected language: one token
    assert speech.prompt_tokens(TRANSCRIPTIONS, {**english, "prompt": "hello"}) > 4  # <|prev|> text first


def test_an_image_file_is_priced_with_its_images_and_nothing_is_stored(runtime, vlm_model: Path) -> None:
    registration.add(runtime, AddRequest("vlm", str(vlm_model)), echo=lambda _: None)
    text_only = _estimate(runtime, [chat_line("text", QUESTION, model="vlm")])
    assert "media" not in text_only
    text_tokens = text_only["input_tokens"]

    square, wide = data_url(image_bytes(64, 64)), data_url(image_bytes(48, 24, (10, 200, 10)))
    lines = [
        image_line("square", square, QUESTION),
        image_line("square-again", square, QUESTION),  # one URL: read once, counted each time
        image_line("wide", wide, QUESTION),
        image_line("link", "https://images.example.com/cat.png", QUESTION),  # not fetched
        image_line("broken", "data:image/png;base64,AAAA", QUESTION),  # refused in a batch: free
    ]
    before = set(runtime.store.list(""))
    e = _estimate(runtime, lines)
    largest = image_tokens_for(str(vlm_model), {}).largest()
    image_tokens = 2 * SQUARE_IMAGE_TOKENS + WIDE_IMAGE_TOKENS + largest
    assert e["media"] == {
        "images": 3,
        "image_links": 1,
        "images_refused": 1,
        "images_not_counted": 0,
        "image_tokens": image_tokens,
        "audio_lines": 0,
        "audio_refused": 0,
        "audio_seconds": 0.0,
        "audio_tokens": 0,
    }
    # each line's text as the text-only line's, plus its image as the engine counts it
    assert e["input_tokens"] == 5 * text_tokens + image_tokens
    assert e["requests"] == 5
    assert {k for k in set(runtime.store.list("")) - before if "/images/" in k} == set()  # nothing stored


def test_an_image_for_a_text_only_model_costs_nothing(runtime, demo_model: Path) -> None:
    text_only = _estimate(runtime, [chat_line("text", QUESTION)])
    e = _estimate(runtime, [image_line("img", data_url(image_bytes()), QUESTION, model="demo")])
    assert e["media"]["images_refused"] == 1 and e["media"]["image_tokens"] == 0
    assert e["input_tokens"] == text_only["input_tokens"]


def test_an_audio_file_is_priced_by_its_durations(runtime, whisper_model: Path) -> None:
    registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    lines = [
        audio_line("en", tone(2.2), language="en"),
        audio_line("detected", tone(1.0, rate=44_100, channels=2, fmt="FLAC")),
        audio_line("noise", b"not audio at all", language="en"),  # the engine's 400: free
        audio_line("long", tone(45.0, rate=8_000), language="en"),  # two chunks: two decoder prompts
    ]
    e = _estimate(runtime, lines, TRANSCRIPTIONS)
    assert e["media"]["audio_lines"] == 4 and e["media"]["audio_refused"] == 1
    assert e["media"]["audio_seconds"] == pytest.approx(48.2, abs=1e-3)
    assert e["input_tokens"] == e["media"]["audio_tokens"] == (4 + 220) + (4 + 100) + (2 * 4 + 4500)
    assert e["input_tokens_lower_bound_requests"] == 0  # counted as the engine counts them


def test_a_parquet_audio_file_is_priced_as_its_jsonl_lines(runtime, whisper_model: Path) -> None:
    """A dry run of a Parquet file with an ``audio`` column reads each cell's header as it reads a
    JSONL line's data URL: the same seconds, refusals and tokens, nothing stored."""
    import pyarrow as pa

    from tests.factories import parquet_bytes

    registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    sounds = [tone(2.2), tone(1.0, rate=44_100, channels=2, fmt="FLAC"), b"not audio at all", tone(2.2)]
    languages = ["en", None, "en", "en"]
    table = pa.table(
        {
            "custom_id": ["en", "detected", "noise", "again"],
            "audio": pa.array(sounds, pa.binary()),
            "model": ["whisper"] * 4,
            "language": languages,
        }
    )
    lines = [
        audio_line(str(i), sound, **({"language": language} if language else {}))
        for i, (sound, language) in enumerate(zip(sounds, languages, strict=True))
    ]
    from_parquet = _estimate(runtime, parquet_bytes(table), TRANSCRIPTIONS)
    assert from_parquet["media"] == _estimate(runtime, lines, TRANSCRIPTIONS)["media"]
    assert from_parquet["media"]["audio_refused"] == 1
    assert from_parquet["input_tokens"] == 2 * (4 + 220) + (4 + 100)
    assert not list(runtime.store.list("batches/"))


def test_images_and_audio_by_file_id_are_read_from_the_tenants_own_files(
    runtime, vlm_model: Path, whisper_model: Path
) -> None:
    """A file id is priced as validation would read it: the tenant's own file by its header, another
    tenant's as the refused line it will be (free)."""
    for name, path in (("vlm", vlm_model), ("whisper", whisper_model)):
        registration.add(runtime, AddRequest(name, str(path)), echo=lambda _: None)
    tenant, key = create_tenant(runtime.db, "files", now())
    other, _ = create_tenant(runtime.db, "others", now())
    mine = intake.upload(runtime, tenant.id, "vision", "a.png", io.BytesIO(image_bytes(64, 64))).id
    theirs = intake.upload(runtime, other.id, "vision", "a.png", io.BytesIO(image_bytes(64, 64))).id
    lines = [image_line("mine", mine, QUESTION), image_line("theirs", theirs, QUESTION)]
    e = _estimate(runtime, lines, key=key)
    assert (e["media"]["images"], e["media"]["images_refused"]) == (1, 1)
    assert e["media"]["image_tokens"] == SQUARE_IMAGE_TOKENS
    wav = intake.upload(runtime, tenant.id, "user_data", "a.wav", io.BytesIO(tone(2.2))).id
    line = audio_line("en", b"", language="en")
    line["body"]["file_url"] = wav
    e = _estimate(runtime, [line], TRANSCRIPTIONS, key=key)
    assert (e["media"]["audio_lines"], e["media"]["audio_refused"]) == (1, 0)
    assert e["input_tokens"] == 4 + 220  # as the engine counts the line (test_transcription_engine)


def test_a_files_image_urls_are_remembered_in_bounded_memory(vlm_model: Path, monkeypatch) -> None:
    import workers.media_tokens as media_tokens

    monkeypatch.setattr(media_tokens, "_URL_MEMORY", 2)
    counter = MediaCounter(
        "/v1/chat/completions",
        lambda model: str(vlm_model),
        lambda model: {},
        lambda path: None,
        {},
        max_image_bytes=1 << 20,
        max_pixels=1 << 24,
        max_audio_seconds=30.0,
    )
    for size in (8, 9, 10, 11, 8):
        body = image_line("x", data_url(image_bytes(size, size)), QUESTION)["body"]
        assert counter.count(json.dumps(body)) == SQUARE_IMAGE_TOKENS
    assert len(counter._urls) == 2 and counter.tally.images == 5
