"""Images and audio a batch line names by file id (workers/media_files.py), on the real database
and object store: a file the tenant uploaded with purpose vision or user_data is read at
validation, stored once per distinct content beside the batch's shards and written back as the
reference the engine worker reads; another tenant's id, an unknown, deleted or expired one is that
line's 404 file_not_found (the same words for each), a file over the byte limit or of another
purpose the line's 400, and the file's other lines go on. The live path (a vision model and a
Whisper model running lines by file id) is in tests/e2e/test_images_live.py and
tests/e2e/test_transcription_live.py."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select

from api.services.files import delete as delete_file
from api.services.tenants import create_tenant
from storage.errors import ServiceError
from storage.models import Batch, ValidationChunk
from storage.runtime import Runtime
from storage.shards import read_rows
from storage.status import BatchStatus
from tests import factories
from tests.audio_factories import TRANSCRIPTIONS, audio_line, tone
from tests.conftest import now
from tests.factories import data_url, image_bytes, image_line
from workers import intake, media_files, registration
from workers.images import IMAGE_REF, REFUSED_REF, ImageResolver, image_key
from workers.media_files import AUDIO_REF, AudioCache, AudioFiles, audio_key, read_audio_ref, store_once
from workers.registration import AddRequest
from workers.request_bodies import REFUSED_LINE, RequestError, parse_body
from workers.transcription import load_audio
from workers.validation import FileRules, ValidLine, check_line, is_refused, validate_batch

RED = image_bytes(32, 32, (200, 30, 30))
WAV = tone(0.5)


@pytest.fixture
def rt(settings) -> Iterator[Runtime]:
    runtime = Runtime(replace(settings, image_max_bytes=100_000, max_file_bytes=4 * 1024 * 1024))
    yield runtime
    runtime.db.dispose()


@pytest.fixture
def tenants(rt) -> tuple[str, str]:
    alpha, _ = create_tenant(rt.db, "alpha", now())
    beta, _ = create_tenant(rt.db, "beta", now())
    return alpha.id, beta.id


def _upload(rt: Runtime, tenant_id: str, data: bytes, purpose: str = "vision", name: str = "m.bin") -> str:
    return intake.upload(rt, tenant_id, purpose, name, io.BytesIO(data)).id


def _part(resolver: ImageResolver, url: str) -> dict:
    body = image_line("x", url)["body"]
    assert resolver.resolve("vlm", body)
    return body["messages"][0]["content"][0]


def test_uploads_take_the_media_purposes_and_refuse_the_others(rt, tenants) -> None:
    alpha, _ = tenants
    for media in ("vision", "user_data"):
        assert intake.upload(rt, alpha, media, "a.png", io.BytesIO(RED)).purpose == media
    for purpose in ("assistants", "fine-tune", "evals", None):
        with pytest.raises(ServiceError) as refused:
            intake.upload(rt, alpha, purpose, "a.png", io.BytesIO(RED))
        assert refused.value.param == "purpose" and "vision, user_data" in refused.value.message
    # a media file is no batch input
    with pytest.raises(ServiceError) as not_input:
        intake.create(
            rt, alpha, {"input_file_id": _upload(rt, alpha, RED), "endpoint": "/v1/chat/completions"}
        )
    assert "purpose=batch" in not_input.value.message


def test_an_image_by_file_id_is_the_tenants_own_stored_once_per_content(rt, tenants) -> None:
    alpha, beta = tenants
    resolver = ImageResolver(rt, "batch_media", alpha, lambda model: True)
    red_ref = IMAGE_REF + hashlib.sha256(RED).hexdigest()
    mine = _upload(rt, alpha, RED, "vision")
    also_mine = _upload(rt, alpha, RED, "user_data")
    # by id, by another id of the same bytes and as a data URL: one object, one reference
    for url in (mine, also_mine, data_url(RED)):
        assert _part(resolver, url) == {"type": "image_url", "image_url": {"url": red_ref}}
    assert list(rt.store.list("batches/batch_media/images/")) == [image_key("batch_media", red_ref[-64:])]

    def refused(url: str) -> dict:
        part = _part(resolver, url)
        assert part["image_url"] == {"url": REFUSED_REF}, part
        assert part["refused"]["param"] == "messages.0.content.0"
        return part["refused"]

    theirs = _upload(rt, beta, image_bytes(8, 8, (1, 2, 3)), "vision")
    unknown = "file-" + "0" * 24
    gone = _upload(rt, alpha, image_bytes(9, 9), "vision")
    delete_file(rt, alpha, gone)
    words = set()
    for file_id in (theirs, unknown, gone):
        refusal = refused(file_id)
        assert (refusal["code"], refusal["status"]) == ("file_not_found", 404)
        words.add(refusal["message"].replace(file_id, "ID"))
    assert words == {"`messages.0.content.0`: No such File object: ID"}  # another's id says no more
    big = _upload(rt, alpha, image_bytes(400, 400, fmt="BMP"), "vision")  # 480 kB > 100 kB
    refusal = refused(big)
    assert refusal["code"] == "image_too_large" and "the limit is 100000" in refusal["message"]
    assert "status" not in refusal  # a 400, as every image refusal
    batch_input = _upload(rt, alpha, b'{"a": 1}\n', "batch", "in.jsonl")
    assert refused(batch_input)["code"] == "invalid_file_purpose"
    assert refused(_upload(rt, alpha, b"not an image", "vision"))["code"] == "invalid_image"
    assert len(list(rt.store.list("batches/batch_media/images/"))) == 1  # nothing refused was stored
    # when the line runs: the refusal is its error, with its status
    body = image_line("x", theirs)["body"]
    resolver.resolve("vlm", body)
    with pytest.raises(RequestError) as at_run_time:
        parse_body("/v1/chat/completions", body, validated=True)
    assert (at_run_time.value.code, at_run_time.value.status_code) == ("file_not_found", 404)


def test_a_responses_input_image_by_file_id(rt, tenants) -> None:
    alpha, beta = tenants
    resolver = ImageResolver(rt, "batch_responses", alpha, lambda model: True)
    mine, theirs = _upload(rt, alpha, RED), _upload(rt, beta, RED)
    content = [
        {"type": "input_image", "file_id": mine},
        {"type": "input_text", "text": "What colour is it?"},
        {"type": "input_image", "file_id": theirs, "detail": "low"},
        {"type": "input_image", "file_id": "not-a-file-id"},
    ]
    body: dict[str, Any] = {"model": "vlm", "input": [{"role": "user", "content": content}]}
    parse_body("/v1/responses", body)  # the tenant's body passes its shape checks
    assert resolver.resolve("vlm", body)
    good, _, other, junk = body["input"][0]["content"]
    assert good == {"type": "input_image", "image_url": IMAGE_REF + hashlib.sha256(RED).hexdigest()}
    for part, param in ((other, "input.0.content.2"), (junk, "input.0.content.3")):
        assert part["image_url"] == REFUSED_REF and "file_id" not in part
        assert (part["refused"]["code"], part["refused"]["param"]) == ("file_not_found", param)
    with pytest.raises(RequestError) as error:
        parse_body("/v1/responses", body, validated=True)
    assert (error.value.code, error.value.param, error.value.status_code) == (
        "file_not_found",
        "input.0.content.2",
        404,
    )
    both = {"type": "input_image", "file_id": mine, "image_url": data_url(RED)}
    with pytest.raises(RequestError) as twice:
        parse_body("/v1/responses", {"model": "vlm", "input": [{"role": "user", "content": [both]}]})
    assert twice.value.param == "input.0.content.0.file_id"


def test_audio_by_file_id_is_stored_for_the_batch_and_read_by_the_engine_side(rt, tenants) -> None:
    alpha, beta = tenants
    audio = AudioFiles(rt, "batch_audio", alpha)
    mine = _upload(rt, alpha, WAV, "user_data", "a.wav")
    body = audio_line("a", b"", model="whisper", language="en")["body"] | {"file_url": mine}
    parse_body(TRANSCRIPTIONS, dict(body))  # a file id passes the tenant body's checks
    assert audio.resolve(body)
    ref = AUDIO_REF + hashlib.sha256(WAV).hexdigest()
    assert body["file_url"] == ref
    assert list(rt.store.list("batches/batch_audio/audio/")) == [audio_key("batch_audio", ref[-64:])]
    # the engine side: the stored body parses, and its audio is read from the batch's object
    parsed = parse_body(TRANSCRIPTIONS, body, validated=True)
    decoded = load_audio(parsed.request, read=lambda r: read_audio_ref(rt, "batch_audio", r))
    assert decoded.seconds == pytest.approx(0.5)
    # a tenant cannot name a stored reference itself
    with pytest.raises(RequestError) as forged:
        parse_body(TRANSCRIPTIONS, {**body, "file_url": ref})
    assert forged.value.param == "file_url"
    # data URLs are untouched but in an audio batch's resolver (``data_urls``: validation's)
    assert not audio.resolve(audio_line("d", WAV, model="whisper")["body"])

    def refused(file_id: str, files: AudioFiles = audio) -> RequestError:
        line = audio_line("x", b"", model="whisper")["body"] | {"file_url": file_id}
        assert files.resolve(line)
        assert list(line) == [REFUSED_LINE, "model"]  # the stored body is the line's error
        with pytest.raises(RequestError) as at_run_time:
            parse_body(TRANSCRIPTIONS, line, validated=True)
        assert at_run_time.value.param == "file_url"
        return at_run_time.value

    theirs = _upload(rt, beta, WAV, "user_data", "a.wav")
    for file_id in (theirs, "file-unknown", "file-../../x", "file-" + "x" * 100_000):
        error = refused(file_id)
        assert (error.code, error.status_code) == ("file_not_found", 404), error
    assert max(len(k) for k in audio._outcomes) <= 69  # what is no file id is not remembered
    small = AudioFiles(rt, "batch_audio", alpha, max_bytes=len(WAV) - 1)
    too_large = refused(mine, small)
    assert (too_large.code, too_large.status_code) == ("audio_too_large", 400)
    assert parsed.request.file_url == ref


def test_the_engine_workers_audio_is_read_ahead_with_its_pack(rt, tenants) -> None:
    """The feed's thread reads a pack's stored audio (``AudioCache.prefetch``), so the engine loop
    submits the line from memory: the objects deleted after the prefetch, every line still reads
    its bytes, and the store was read once per distinct audio, none of them on submit."""
    alpha, _ = tenants
    files = AudioFiles(rt, "batch_ahead", alpha)
    sounds = [tone(0.5), tone(0.7)]
    bodies = []
    for i, sound in enumerate(sounds * 2):  # two lines name each file
        file_id = _upload(rt, alpha, sound, "user_data")
        body = audio_line(str(i), b"", model="whisper")["body"] | {"file_url": file_id}
        assert files.resolve(body)
        bodies.append(body)
    rows = [json.dumps(b) for b in bodies] + [json.dumps(audio_line("d", WAV, model="whisper")["body"]), "[]"]
    cache = AudioCache(rt)
    cache.prefetch("batch_ahead", iter(rows))
    assert cache.loads == 2
    for key in list(rt.store.list("batches/batch_ahead/audio/")):
        rt.store.delete(key)
    read = cache.reader("batch_ahead")
    for body, sound in zip(bodies, sounds * 2, strict=True):
        assert read(body["file_url"]) == sound
    assert (cache.loads, cache.late_reads) == (2, 0)
    # past its bound the least recently used is dropped, and read again when its line is submitted
    small = AudioCache(rt, max_bytes=len(sounds[1]))
    for body, sound in zip(bodies[:2], sounds, strict=True):
        rt.store.put_chunks(audio_key("batch_ahead", body["file_url"][-64:]), [sound])
    small.prefetch("batch_ahead", (json.dumps(b) for b in bodies[:2]))
    assert small.reader("batch_ahead")(bodies[0]["file_url"]) == sounds[0]
    assert (small.loads, small.late_reads) == (3, 1)


def test_validation_resolves_file_ids_line_by_line(rt, tenants) -> None:
    """Through validation's line check: each line's file id is resolved or refused alone, and the
    stored body holds the reference or the refusal."""
    alpha, beta = tenants
    mine_audio = _upload(rt, alpha, WAV, "user_data", "a.wav")
    theirs_audio = _upload(rt, beta, WAV, "user_data", "a.wav")
    rules = FileRules(
        TRANSCRIPTIONS,
        frozenset({"whisper", "vlm"}),
        max_requests=10,
        max_line_bytes=1 << 20,
        speech_models=frozenset({"whisper"}),
        images=ImageResolver(rt, "batch_lines", alpha, lambda model: model == "vlm"),
    )
    stored = {}
    for custom_id, file_id in (("mine", mine_audio), ("theirs", theirs_audio)):
        line = audio_line(custom_id, b"", model="whisper", language="en")
        line["body"]["file_url"] = file_id
        checked = check_line(json.dumps(line).encode(), 1, rules)
        assert isinstance(checked, ValidLine), checked
        stored[custom_id] = json.loads(checked.row.body_json)
    assert stored["mine"]["file_url"] == AUDIO_REF + hashlib.sha256(WAV).hexdigest()
    assert stored["theirs"][REFUSED_LINE]["code"] == "file_not_found"
    chat_rules = replace(rules, endpoint="/v1/chat/completions", speech_models=frozenset())
    image_id = _upload(rt, alpha, RED)
    checked = check_line(json.dumps(image_line("img", image_id)).encode(), 2, chat_rules)
    assert isinstance(checked, ValidLine), checked
    part = json.loads(checked.row.body_json)["messages"][0]["content"][0]
    assert part["image_url"]["url"] == IMAGE_REF + hashlib.sha256(RED).hexdigest()
    # a part spelled with \u escapes (no "image_url" in its bytes) is found all the same
    escaped = json.dumps(image_line("esc", data_url(RED))).replace('"image_url"', '"image\\u005furl"')
    assert b'"image_url"' not in escaped.encode()
    checked = check_line(escaped.encode(), 3, chat_rules)
    assert isinstance(checked, ValidLine), checked
    part = json.loads(checked.row.body_json)["messages"][0]["content"][0]
    assert part["image_url"]["url"] == IMAGE_REF + hashlib.sha256(RED).hexdigest()


def test_a_transcription_batch_naming_files_validates_with_a_row_a_line(rt, tenants, whisper_model) -> None:
    """The whole validation of an audio batch on a registered Whisper model: the good file id
    becomes the stored audio's reference, another tenant's is a refused row (free, with its model),
    the data URL line of the same bytes names the same object; the batch is validated, not failed."""
    alpha, beta = tenants
    registration.add(rt, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    mine = _upload(rt, alpha, WAV, "user_data", "a.wav")
    theirs = _upload(rt, beta, WAV, "user_data", "a.wav")
    lines = [audio_line("data", WAV, language="en")]
    for custom_id, file_id in (("mine", mine), ("theirs", theirs)):
        line = audio_line(custom_id, b"", language="en")
        line["body"]["file_url"] = file_id
        lines.append(line)
    batch_id = factories.upload_and_create(rt, alpha, lines, endpoint=TRANSCRIPTIONS).id
    validate_batch(rt, batch_id)
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.status != BatchStatus.FAILED, batch.errors
    rows = {}
    for key in rt.store.list(f"batches/{batch_id}/shards/"):
        rows.update({row.custom_id: row for row in read_rows(rt.store, key, 0, 100)})
    assert set(rows) == {"data", "mine", "theirs"}
    assert json.loads(rows["data"].body_json)["file_url"] == AUDIO_REF + hashlib.sha256(WAV).hexdigest()
    assert json.loads(rows["mine"].body_json)["file_url"] == AUDIO_REF + hashlib.sha256(WAV).hexdigest()
    assert is_refused(rows["theirs"])
    with pytest.raises(RequestError) as refused:
        parse_body(TRANSCRIPTIONS, json.loads(rows["theirs"].body_json), validated=True)
    assert (refused.value.code, refused.value.status_code) == ("file_not_found", 404)
    assert list(rt.store.list(f"batches/{batch_id}/audio/")) == [
        audio_key(batch_id, hashlib.sha256(WAV).hexdigest())
    ]


def _audio_parquet(rows: dict[str, list], row_group_size: int | None = None) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {
        name: pa.array(values, pa.binary()) if name == "audio" and any(isinstance(v, bytes) for v in values)
        else values
        for name, values in rows.items()
    }  # fmt: skip
    out = io.BytesIO()
    pq.write_table(pa.table(columns), out, row_group_size=row_group_size)
    return out.getvalue()


@pytest.mark.parametrize("chunk_bytes", [0, 1], ids=["one-task", "chunks"])
def test_a_parquet_audio_column_is_stored_once_per_content(rt, tenants, whisper_model, chunk_bytes) -> None:
    """A Parquet transcription file's binary ``audio`` cells, validated in one task and in chunks
    of its row groups: each distinct audio is one object of the batch, each row's stored body names
    it (no audio bytes in the shards); a file id cell is read as a JSONL line's is, another
    tenant's is that row's refusal (the ``file_url`` column, beside ``audio``); bytes that are no
    audio are that row's ``invalid_audio`` refusal at validation, stored nowhere (as a JSONL line's
    data URL), and the engine side reads the rest back."""

    alpha, beta = tenants
    runtime = Runtime(replace(rt.settings, validation_chunk_bytes=chunk_bytes))
    registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    other = tone(0.7)
    mine = _upload(runtime, alpha, WAV, "user_data", "a.wav")
    theirs = _upload(runtime, beta, WAV, "user_data", "a.wav")
    data = _audio_parquet(
        {
            "custom_id": ["a1", "a2", "b", "a3", "mine", "theirs", "noise"],
            "audio": [WAV, WAV, other, WAV, None, None, b"this is not audio"],
            "file_url": [None, None, None, None, mine, theirs, None],
            "language": ["en"] * 7,
        },
        row_group_size=2,
    )
    batch_id = factories.upload_and_create(
        runtime,
        alpha,
        data,
        name="audio.parquet",
        endpoint=TRANSCRIPTIONS,
        metadata={"default_model": "whisper"},
    ).id
    rows, shard_bytes = _validated_rows(runtime, batch_id, chunked=bool(chunk_bytes))
    assert set(rows) == {"a1", "a2", "a3", "b", "mine", "theirs", "noise"}
    assert all("data:" not in row.body_json for row in rows.values())
    bodies = {custom_id: json.loads(row.body_json) for custom_id, row in rows.items()}
    digest = hashlib.sha256(WAV).hexdigest()
    for custom_id in ("a1", "a2", "a3", "mine"):
        assert bodies[custom_id] == {"model": "whisper", "file_url": AUDIO_REF + digest, "language": "en"}
    assert bodies["b"]["file_url"] == AUDIO_REF + hashlib.sha256(other).hexdigest()
    assert is_refused(rows["theirs"]) and is_refused(rows["noise"])
    with pytest.raises(RequestError) as refused:
        parse_body(TRANSCRIPTIONS, bodies["theirs"], validated=True)
    assert (refused.value.code, refused.value.status_code) == ("file_not_found", 404)
    with pytest.raises(RequestError) as noise:
        parse_body(TRANSCRIPTIONS, bodies["noise"], validated=True)
    assert (noise.value.code, noise.value.param) == ("invalid_audio", "file_url")
    stored = sorted(runtime.store.list(f"batches/{batch_id}/audio/"))
    contents = (WAV, other)
    assert stored == sorted(audio_key(batch_id, hashlib.sha256(c).hexdigest()) for c in contents)
    assert WAV[100:164] not in shard_bytes  # the audio is in its objects only
    read = lambda ref: read_audio_ref(runtime, batch_id, ref)  # noqa: E731
    parsed = parse_body(TRANSCRIPTIONS, bodies["a2"], validated=True)
    assert load_audio(parsed.request, read=read).seconds == pytest.approx(0.5)
    runtime.db.dispose()


def test_a_parquet_audio_files_bad_rows_are_refused_as_jsonl_lines_are(rt, tenants, whisper_model) -> None:
    """A Parquet row meets a JSONL audio line's checks: a response format or word timestamps a
    batch cannot have are that line's ``unsupported_parameter`` when it runs (its stored body
    parses to the same refusal), a cell past the line limit fails the file naming its row, and audio
    past the byte limit is that line's ``audio_too_large``."""
    alpha, _ = tenants
    runtime = Runtime(replace(rt.settings, max_line_bytes=40_000))
    registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)

    def validated(rows: dict[str, list]) -> tuple[Batch, dict[str, dict]]:
        data = _audio_parquet({**rows, "model": ["whisper"] * len(rows["custom_id"])})
        batch_id = factories.upload_and_create(
            runtime, alpha, data, name="rows.parquet", endpoint=TRANSCRIPTIONS
        ).id
        validate_batch(runtime, batch_id)
        with runtime.db.read() as s:
            batch = s.get(Batch, batch_id)
        assert batch is not None
        bodies = {}
        for key in runtime.store.list(f"batches/{batch_id}/shards/"):
            bodies.update(
                {r.custom_id: json.loads(r.body_json) for r in read_rows(runtime.store, key, 0, 100)}
            )
        return batch, bodies

    batch, bodies = validated(
        {
            "custom_id": ["ok", "srt", "words"],
            "audio": [WAV[:2000]] * 3,
            "response_format": [None, "srt", "verbose_json"],
            "timestamp_granularities": [None, None, ["word"]],
        }
    )
    assert batch.status != BatchStatus.FAILED, batch.errors
    assert parse_body(TRANSCRIPTIONS, bodies["ok"], validated=True).request.file_url.startswith(AUDIO_REF)
    for custom_id, param in (("srt", "response_format"), ("words", "timestamp_granularities")):
        with pytest.raises(RequestError) as refused:
            parse_body(TRANSCRIPTIONS, bodies[custom_id], validated=True)
        assert (refused.value.code, refused.value.param) == ("unsupported_parameter", param)
    batch, _ = validated({"custom_id": ["ok", "long"], "audio": [WAV[:2000], tone(1.5)]})
    assert batch.status == BatchStatus.FAILED
    assert [(e["line"], e["code"]) for e in batch.errors["data"]] == [(2, "line_too_large")]
    assert batch.errors["data"][0]["message"].startswith("row 2 is ")
    runtime.db.dispose()
    # past the audio byte limit: the stored body is that line's refusal, as a file id's is
    small = AudioFiles(rt, "batch_small", alpha, max_bytes=len(WAV) - 1, data_urls=True)
    body = audio_line("x", WAV, model="whisper")["body"]
    assert small.resolve(body) and list(body) == [REFUSED_LINE, "model"]
    with pytest.raises(RequestError) as too_large:
        parse_body(TRANSCRIPTIONS, body, validated=True)
    assert (too_large.value.code, too_large.value.param) == ("audio_too_large", "file_url")
    assert not list(rt.store.list("batches/batch_small/"))


def test_a_parquet_body_columns_audio_data_urls_are_stored_once_too(rt, tenants, whisper_model) -> None:
    """The OpenAI batch columns of a Parquet file: bodies as JSON text with their audio as data
    URLs are stored as the audio column's cells are (an audio batch's data URLs, whatever its
    shape or format), three rows over two recordings leaving two objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    alpha, _ = tenants
    registration.add(rt, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    lines = [audio_line(str(i), sound, language="en") for i, sound in enumerate([WAV, tone(0.7), WAV])]
    table = pa.table(
        {"custom_id": [x["custom_id"] for x in lines], "body": [json.dumps(x["body"]) for x in lines]}
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    batch_id = factories.upload_and_create(
        rt, alpha, out.getvalue(), name="b.parquet", endpoint=TRANSCRIPTIONS
    ).id
    validate_batch(rt, batch_id)
    bodies = {}
    for key in rt.store.list(f"batches/{batch_id}/shards/"):
        bodies.update({r.custom_id: json.loads(r.body_json) for r in read_rows(rt.store, key, 0, 10)})
    assert bodies["0"]["file_url"] == bodies["2"]["file_url"] == AUDIO_REF + hashlib.sha256(WAV).hexdigest()
    assert len(list(rt.store.list(f"batches/{batch_id}/audio/"))) == 2


def test_store_once_checks_and_writes_an_object_once_per_batch(rt, monkeypatch) -> None:
    """The one write of a batch's media (images and audio alike): an object is checked and written
    the first time; a resolver that stored it does not ask again (the object deleted behind its back
    stays deleted); another resolver of the batch finds it in the store and neither checks nor
    writes it (a marker put in its place stays); bytes the check refuses are not stored or
    remembered; past STORED_MEMORY digests are stored and no longer remembered."""
    checked: list[bytes] = []
    key_of = lambda digest: audio_key("batch_once", digest)  # noqa: E731
    digest = hashlib.sha256(WAV).hexdigest()
    first: set[str] = set()
    assert store_once(rt.store, WAV, key_of, first, checked.append) == digest
    assert checked == [WAV] and first == {digest}
    with rt.store.open(key_of(digest)) as stream:
        assert stream.read() == WAV
    rt.store.delete(key_of(digest))
    assert store_once(rt.store, WAV, key_of, first, checked.append) == digest
    assert checked == [WAV] and not rt.store.exists(key_of(digest))  # remembered: not asked again
    second: set[str] = set()  # another chunk's resolver
    assert store_once(rt.store, WAV, key_of, second, checked.append) == digest
    assert checked == [WAV, WAV] and rt.store.exists(key_of(digest))  # not in the store: checked, written
    rt.store.put_chunks(key_of(digest), [b"marker"])
    third: set[str] = set()
    assert store_once(rt.store, WAV, key_of, third, checked.append) == digest
    assert checked == [WAV, WAV] and third == {digest}
    with rt.store.open(key_of(digest)) as stream:
        assert stream.read() == b"marker"  # found in the store: not written again

    def refuse(data: bytes) -> None:
        raise ValueError("refused")

    other = tone(0.7)
    with pytest.raises(ValueError):
        store_once(rt.store, other, key_of, third, refuse)
    assert third == {digest} and not rt.store.exists(key_of(hashlib.sha256(other).hexdigest()))
    monkeypatch.setattr(media_files, "STORED_MEMORY", 1)
    assert store_once(rt.store, other, key_of, third) == hashlib.sha256(other).hexdigest()
    assert third == {digest} and rt.store.exists(key_of(hashlib.sha256(other).hexdigest()))


def test_audio_another_resolver_of_the_batch_stored_is_not_written_again(rt, tenants) -> None:
    """The audio side of ``store_once``: a data URL's and a file id's audio of the same bytes are one
    object of the batch; a second resolver of the batch (a validation chunk's) refers to it without
    writing it (a marker in its place stays), one of another batch stores its own."""
    alpha, _ = tenants
    first = AudioFiles(rt, "batch_twice", alpha, data_urls=True)
    ref = AUDIO_REF + hashlib.sha256(WAV).hexdigest()
    by_url = audio_line("u", WAV, model="whisper")["body"]
    file_id = _upload(rt, alpha, WAV, "user_data")
    by_file = audio_line("f", b"", model="whisper")["body"] | {"file_url": file_id}
    assert first.resolve(by_url) and first.resolve(by_file)
    assert by_url["file_url"] == by_file["file_url"] == ref
    assert list(rt.store.list("batches/batch_twice/")) == [audio_key("batch_twice", ref[-64:])]
    rt.store.put_chunks(audio_key("batch_twice", ref[-64:]), [b"marker"])
    second = AudioFiles(rt, "batch_twice", alpha, data_urls=True)
    body = audio_line("u2", WAV, model="whisper")["body"]
    assert second.resolve(body) and body["file_url"] == ref
    with rt.store.open(audio_key("batch_twice", ref[-64:])) as stream:
        assert stream.read() == b"marker"
    other = AudioFiles(rt, "batch_else", alpha, data_urls=True)
    assert other.resolve(audio_line("u3", WAV, model="whisper")["body"])
    with rt.store.open(audio_key("batch_else", ref[-64:])) as stream:
        assert stream.read() == WAV


def _written(line: dict, way: int) -> bytes:
    """A JSONL line as tenants write it: json.dumps' spacing, compact, other whitespace about the
    colon, or the key and the data URL spelled with \\u escapes."""
    text = json.dumps(line)
    if way == 1:
        text = json.dumps(line, separators=(",", ":"))
    elif way == 2:
        text = text.replace('"file_url": "data:', '"file_url" :\t  "data:')
    elif way == 3:
        text = text.replace('"file_url": "data:', '"file\\u005furl": "\\u0064ata:')
    return text.encode()


@pytest.mark.parametrize("chunk_bytes", [0, 64_000], ids=["one-task", "chunks"])  # chunks: about 3 lines
def test_a_jsonl_audio_batch_stores_each_distinct_clip_once(rt, tenants, whisper_model, chunk_bytes) -> None:
    """A JSONL transcription file's data URLs are stored as a Parquet file's audio cells are, in one
    task and in chunks: twelve lines over three clips, each clip written each of four ways
    (``_written``), leave three objects of the batch and rows naming them (no base64 in the
    shards); a line whose data URL is not base64, and one whose bytes are no audio, are that
    line's ``invalid_audio`` refusal, and a clip past FREIGHT_MAX_AUDIO_SECONDS its
    ``audio_too_long``, all at validation (its header read, no sample decoded; nothing stored for
    them), and the other lines validate."""

    alpha, _ = tenants
    runtime = Runtime(replace(rt.settings, validation_chunk_bytes=chunk_bytes, max_audio_seconds=2.0))
    registration.add(runtime, AddRequest("whisper", str(whisper_model)), echo=lambda _: None)
    clips = [tone(0.5), tone(0.7), tone(0.6, hz=300.0)]
    data = b""
    for i in range(12):  # (i % 3, i % 4): each clip each way
        data += _written(audio_line(f"c{i}", clips[i % 3], language="en"), i % 4) + b"\n"
    bad = audio_line("bad", b"", language="en")
    bad["body"]["file_url"] = "data:audio/wav;base64,@@@@"
    data += json.dumps(bad).encode() + b"\n" + json.dumps(audio_line("noise", b"not audio")).encode() + b"\n"
    data += json.dumps(audio_line("long", tone(2.5))).encode() + b"\n"
    assert data.count(b'"file_url": "data:') == 6  # the others are found however they are spelled
    batch_id = factories.upload_and_create(runtime, alpha, data, endpoint=TRANSCRIPTIONS).id
    rows, shard_bytes = _validated_rows(runtime, batch_id, chunked=bool(chunk_bytes))
    assert len(rows) == 15 and all("data:" not in row.body_json for row in rows.values())
    bodies = {custom_id: json.loads(row.body_json) for custom_id, row in rows.items()}
    for i in range(12):
        assert bodies[f"c{i}"]["file_url"] == AUDIO_REF + hashlib.sha256(clips[i % 3]).hexdigest(), i
    stored = sorted(runtime.store.list(f"batches/{batch_id}/audio/"))
    assert stored == sorted(audio_key(batch_id, hashlib.sha256(c).hexdigest()) for c in clips)
    assert all(clip[200:264] not in shard_bytes for clip in clips)
    for custom_id, code in (("bad", "invalid_audio"), ("noise", "invalid_audio"), ("long", "audio_too_long")):
        assert is_refused(rows[custom_id]), custom_id
        with pytest.raises(RequestError) as refused:
            parse_body(TRANSCRIPTIONS, bodies[custom_id], validated=True)
        assert (refused.value.code, refused.value.param) == (code, "file_url")
    read = lambda ref: read_audio_ref(runtime, batch_id, ref)  # noqa: E731
    for custom_id, seconds in (("c0", 0.5), ("c7", 0.7), ("c11", 0.6)):
        parsed = parse_body(TRANSCRIPTIONS, bodies[custom_id], validated=True)
        assert load_audio(parsed.request, read=read).seconds == pytest.approx(seconds)
    runtime.db.dispose()


def _validated_rows(runtime: Runtime, batch_id: str, chunked: bool) -> tuple[dict, bytes]:
    """Validate the batch as the control worker does (in chunks, then the merge, when ``chunked``;
    in one task otherwise); its shards' rows by custom_id, and the shards' bytes."""
    from workers import validation_chunks

    in_chunks = validation_chunks.validate_in_chunks
    assert validate_batch(runtime, batch_id, in_chunks) is None
    with runtime.db.read() as s:
        chunk_ids = s.scalars(select(ValidationChunk.id).where(ValidationChunk.batch_id == batch_id)).all()
    assert (len(chunk_ids) > 1) == chunked
    for chunk_id in chunk_ids:
        validation_chunks.validate_chunk(runtime, batch_id, chunk_id)
    if chunk_ids:
        assert validate_batch(runtime, batch_id, in_chunks) is None  # the merge
    with runtime.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.status != BatchStatus.FAILED, batch.errors
    rows = {}
    shard_bytes = b""
    for key in runtime.store.list(f"batches/{batch_id}/shards/"):
        rows.update({row.custom_id: row for row in read_rows(runtime.store, key, 0, 100)})
        with runtime.store.open(key) as stream:
            shard_bytes += stream.read()
    return rows, shard_bytes
