"""Transcription and translation batches end to end on the live stack: the demo speech model (a
random Whisper) registered with the CLI (its task, "transcribe", found from its architecture), its
engine worker started from the registry entry, a batch of WAV lines of each endpoint run through
the official client. The good lines answer in OpenAI's shapes (the client's Transcription and
Translation types parse them), usage by duration; an undecodable audio and one past the duration
limit are each that line's 400 while the rest runs. Audio may be a file the tenant uploaded (purpose
user_data) named in file_url; another tenant's file id is that line's 404. Audio past Whisper's 30 s
window runs in chunks (a 45 s file), and verbose_json answers the client's TranscriptionVerbose and
TranslationVerbose. A Parquet file of the same endpoint (an ``audio`` column of WAV bytes, a
``file_url`` column naming a file) runs beside them. In JSONL and Parquet alike each distinct audio
is stored once for the batch, however many lines carry it and however a line's JSON is spaced or
escaped (a data URL that is no base64 is that line's 400), the Parquet output downloaded with each
line's text. Random weights: the path is checked, not the text."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types.audio import Transcription, TranscriptionVerbose, Translation, TranslationVerbose

from infra.processes import FREIGHT, REPO
from tests.audio_factories import TRANSCRIPTIONS, TRANSLATIONS, audio_line, tone
from tests.e2e.batch_client import converted
from tests.e2e.conftest import LiveStack, engine_worker, wait_final
from tests.factories import jsonl, parquet_bytes

pytestmark = pytest.mark.stack

MODEL = "whisper-live"


def _freight(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FREIGHT, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _line(custom_id: str, data: bytes, url: str = TRANSCRIPTIONS, **body: Any) -> dict:
    return audio_line(custom_id, data, url=url, model=MODEL, max_completion_tokens=8, **body)


def _by_file(custom_id: str, file_id: str, **body: Any) -> dict:
    """A line whose audio is a file uploaded before, named by its id where the data URL goes."""
    line = _line(custom_id, b"", **body)
    line["body"]["file_url"] = file_id
    return line


def test_transcription_and_translation_batches_run_on_a_whisper_model(
    live: LiveStack, whisper_model: Path
) -> None:
    env = {**live.worker_env, "FREIGHT_MAX_AUDIO_SECONDS": "50"}
    added = _freight(env, "models", "add", MODEL, "--path", str(whisper_model))
    assert added.returncode == 0, added.stderr[-2000:]
    assert "a speech model: it serves /v1/audio/transcriptions" in added.stdout
    try:
        client = live.client("alpha")
        served = {m.id: m.model_extra["x_freight"] for m in client.models.list().data}
        assert (served[MODEL]["task"], served[MODEL]["quantization"]) == ("transcribe", "none")
        mine = client.files.create(file=("a.wav", tone(2.5, rate=8_000)), purpose="user_data").id
        theirs = live.client("beta").files.create(file=("a.wav", tone(1.0)), purpose="user_data").id
        long = client.files.create(file=("long.wav", tone(45.0, rate=8_000)), purpose="user_data").id
        longer = client.files.create(file=("longer.wav", tone(51.0, rate=8_000)), purpose="user_data").id
        lines = {
            TRANSCRIPTIONS: [
                _line("en", tone(2.2), language="en"),
                _line("detected", tone(1.0, rate=22_050)),
                _line("text", tone(1.0), language="en", response_format="text"),
                _line("noise", b"this is not audio", language="en"),
                _by_file("too-long", longer, language="en"),
                _by_file("by-file", mine, language="en"),
                _by_file("theirs", theirs, language="en"),
                _by_file("long", long, language="en"),  # two chunks
                _by_file("long-verbose", long, language="en", response_format="verbose_json"),
            ],
            TRANSLATIONS: [
                _line("fr", tone(1.5), url=TRANSLATIONS, language="fr"),
                _line("fr-verbose", tone(1.5), url=TRANSLATIONS, response_format="verbose_json"),
            ],
        }
        # clips repeated (stored once each), written as tenants also write JSON: compact, and with
        # a tab and a \u escape where json.dumps puts ": \"data:"; a data URL that is no base64
        bad = _line("bad-base64", b"", language="en")
        bad["body"]["file_url"] = "data:audio/wav;base64,@@@@"
        written_otherwise = [
            json.dumps(_line("en-again", tone(2.2), language="en"), separators=(",", ":")),
            json.dumps(_line("text-again", tone(1.0), language="en")).replace(
                '"file_url": "data:', '"file_url":\t"\\u0064ata:'
            ),
            json.dumps(bad),
        ]
        extra = {TRANSCRIPTIONS: "".join(x + "\n" for x in written_otherwise).encode()}
        batches = {}
        for endpoint, batch_lines in lines.items():
            data = jsonl(batch_lines) + extra.get(endpoint, b"")
            upload = client.files.create(file=("audio.jsonl", data), purpose="batch")
            batches[endpoint] = client.batches.create(
                input_file_id=upload.id,
                endpoint=endpoint,
                completion_window="24h",  # type: ignore[arg-type]
            )
        table = pa.table(
            {
                "custom_id": ["pq-a", "pq-b", "pq-a2", "pq-noise", "pq-file"],
                "audio": pa.array([tone(1.0), tone(1.2), tone(1.0), b"not audio", None], pa.binary()),
                "file_url": [None, None, None, None, mine],
                "language": ["en", "en", None, "en", "en"],
                "max_completion_tokens": [8] * 5,
            }
        ).replace_schema_metadata({"freight.defaults": json.dumps({"model": MODEL})})
        upload = client.files.create(file=("audio.parquet", parquet_bytes(table)), purpose="batch")
        parquet_batch = client.batches.create(
            input_file_id=upload.id,
            endpoint=TRANSCRIPTIONS,
            completion_window="24h",  # type: ignore[arg-type]
        )
        with engine_worker(live, MODEL, "engine-whisper-live", env, "speech engine worker"):
            finals = {endpoint: wait_final(client, b.id, timeout=300) for endpoint, b in batches.items()}
            parquet_final = wait_final(client, parquet_batch.id, timeout=300)
    finally:
        removed = _freight(env, "models", "remove", MODEL)
        assert removed.returncode == 0, removed.stderr
    # the audio of the lines by file id was read ahead with their packs, none when a line was
    # submitted on the engine loop (workers/media_files.AudioCache logs such a read)
    worker_log = live.stack.log("engine-whisper-live").read_text(errors="replace")
    assert "pack " in worker_log and "read on submit" not in worker_log

    def files(final: Any) -> tuple[dict[str, dict], dict[str, dict]]:
        assert final.status == "completed", final
        out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
        err = []
        if final.error_file_id:
            err = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
        ids = [r["custom_id"] for r in out + err]
        assert len(ids) == len(set(ids)), ids  # every line once
        return {r["custom_id"]: r for r in out}, {r["custom_id"]: r for r in err}

    out, err = files(finals[TRANSCRIPTIONS])
    good = {"en", "en-again", "detected", "text", "text-again", "by-file", "long", "long-verbose"}
    assert set(out) == good and set(err) == {"noise", "too-long", "theirs", "bad-base64"}
    seconds_of = {"en": 3, "en-again": 3, "detected": 1, "text": 1, "text-again": 1, "by-file": 3, "long": 45}
    for key, seconds in seconds_of.items():
        response = out[key]["response"]
        assert response["status_code"] == 200
        parsed = Transcription.model_validate(response["body"])
        assert isinstance(parsed.text, str)
        assert response["body"]["usage"] == {"type": "duration", "seconds": seconds}
    refused = {"noise": "invalid_audio", "too-long": "audio_too_long", "bad-base64": "invalid_audio"}
    for key, code in refused.items():
        response = err[key]["response"]
        assert response["status_code"] == 400, response
        assert (response["body"]["error"]["code"], response["body"]["error"]["param"]) == (code, "file_url")
    assert "the limit is 50 s" in err["too-long"]["response"]["body"]["error"]["message"]
    verbose = out["long-verbose"]["response"]["body"]
    parsed_verbose = TranscriptionVerbose.model_validate(verbose)
    assert (parsed_verbose.language, parsed_verbose.duration) == ("en", 45.0)
    assert parsed_verbose.usage is not None and parsed_verbose.usage.seconds == 45
    assert isinstance(parsed_verbose.segments, list)
    assert all(0 <= s.start <= s.end <= 75 for s in parsed_verbose.segments)
    other = err["theirs"]["response"]  # another tenant's file id: as an unknown one
    assert other["status_code"] == 404, other
    assert (other["body"]["error"]["code"], other["body"]["error"]["param"]) == ("file_not_found", "file_url")
    transcribed = finals[TRANSCRIPTIONS]
    assert (transcribed.request_counts.completed, transcribed.request_counts.failed) == (8, 4)
    # input: each chunk's decoder prompt and its audio's log-mel frames (100 a second)
    assert transcribed.usage.input_tokens >= 2 * 220 + 100 + 2 * 100 + 250 + 2 * (2 * 4 + 4500)
    assert 8 <= transcribed.usage.output_tokens <= 8 * 10  # at most 8 a chunk
    # 12 lines, 6 distinct audio stored once each: the data URLs' three (two tones twice, whatever
    # their spelling, one once) and the files' three ("long" named twice); the noise was refused at
    # validation, its header unreadable, and stored nowhere (the 51 s file passed the control
    # worker's limit, the default 600 s, and met the engine worker's 50 s when it ran)
    assert len(list(live.store().list(f"batches/{transcribed.id}/audio/"))) == 6

    out, err = files(finals[TRANSLATIONS])
    assert set(out) == {"fr", "fr-verbose"} and not err
    assert isinstance(Translation.model_validate(out["fr"]["response"]["body"]).text, str)
    translated = TranslationVerbose.model_validate(out["fr-verbose"]["response"]["body"])
    assert translated.duration == 1.5 and isinstance(translated.language, str)
    assert len(list(live.store().list(f"batches/{finals[TRANSLATIONS].id}/audio/"))) == 1  # one clip

    # the Parquet file: its rows ran as the JSONL lines did, each distinct audio stored once
    out, err = files(parquet_final)
    assert set(out) == {"pq-a", "pq-b", "pq-a2", "pq-file"} and set(err) == {"pq-noise"}
    for key in out:
        assert isinstance(Transcription.model_validate(out[key]["response"]["body"]).text, str)
    assert out["pq-b"]["response"]["body"]["usage"] == {"type": "duration", "seconds": 2}
    noise = err["pq-noise"]["response"]
    assert (noise["status_code"], noise["body"]["error"]["code"]) == (400, "invalid_audio")
    # five rows, three distinct audio (two tones, the file) stored once each; the noise refused
    assert len(list(live.store().list(f"batches/{parquet_final.id}/audio/"))) == 3
    raw = converted(
        lambda: client.files.with_raw_response.content(
            parquet_final.output_file_id, extra_query={"format": "parquet"}
        )
    )
    rows = {r["custom_id"]: r for r in pq.read_table(io.BytesIO(raw.content)).to_pylist()}
    assert set(rows) == set(out)
    for key, row in rows.items():
        assert row["status_code"] == 200
        assert row["text"] == out[key]["response"]["body"]["text"]
