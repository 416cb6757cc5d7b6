"""Transcription and translation bodies (vLLM run-batch's shapes: the audio in `file_url`, a data
URL) and their audio: what validation accepts or refuses naming the field, and each kind of bad
audio the line's own error (too large, too long, undecodable), decoded to Whisper's 16 kHz mono."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from tests.audio_factories import TRANSCRIPTIONS, TRANSLATIONS, audio_line, audio_url, tone
from workers.audio import SAMPLE_RATE, AudioError, data_url_bytes, decode, resample
from workers.request_bodies import RequestError, endpoint_mismatch, parse_body, serves
from workers.transcription import load_audio
from workers.validation import FileRules, LineError, ValidLine, check_line

SERVED = frozenset({"demo", "whisper", "embed"})


def _rules(endpoint: str) -> FileRules:
    return FileRules(
        endpoint,
        SERVED,
        max_requests=10,
        max_line_bytes=1 << 20,
        embed_models=frozenset({"embed"}),
        speech_models=frozenset({"whisper"}),
    )


def _check(line: dict, endpoint: str = TRANSCRIPTIONS) -> ValidLine | LineError:
    return check_line(json.dumps(line).encode(), 1, _rules(endpoint))


def _refusal(body: dict, endpoint: str = TRANSCRIPTIONS) -> tuple[str, str | None]:
    with pytest.raises(RequestError) as refused:
        parse_body(endpoint, {"model": "whisper", "file_url": audio_url(tone(0.1)), **body})
    return refused.value.code, refused.value.param


def test_audio_lines_pass_validation_on_a_speech_model_only() -> None:
    for endpoint in (TRANSCRIPTIONS, TRANSLATIONS):
        line = audio_line("a1", tone(0.5), url=endpoint, language="en", max_completion_tokens=20)
        result = _check(line, endpoint)
        assert isinstance(result, ValidLine), result
        assert result.model == "whisper" and result.row.max_tokens == 20
        for model, what in (("demo", "is not a speech model"), ("embed", "is not a speech model")):
            wrong = _check(audio_line("a1", tone(0.5), url=endpoint, model=model), endpoint)
            assert isinstance(wrong, LineError) and (wrong.code, wrong.param) == (
                "invalid_model",
                "body.model",
            )
            assert what in wrong.message and endpoint in wrong.message
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "whisper", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip
    refused = _check(chat, "/v1/chat/completions")
    assert isinstance(refused, LineError) and "is a speech model" in refused.message
    assert serves("transcribe", TRANSLATIONS) and not serves("generate", TRANSCRIPTIONS)
    assert "is a speech model; it serves" in endpoint_mismatch("whisper", "/v1/embeddings", "transcribe")


def test_a_body_is_vllm_run_batch_s_shape() -> None:
    parsed = parse_body(
        TRANSCRIPTIONS,
        {
            "model": "whisper",
            "file_url": audio_url(tone(0.1)),
            "language": "en",
            "prompt": "p",
            "temperature": 0.2,
            "response_format": "text",
        },
    )
    assert parsed.model == "whisper" and parsed.max_tokens is None
    assert parsed.request.task == "transcribe" and parsed.request.request.language == "en"
    assert parse_body(TRANSLATIONS, {"file_url": audio_url(tone(0.1))}).request.task == "translate"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"file_url": None}, "invalid_request", "file_url"),
        ({"file_url": 7}, "invalid_request", "file_url"),
        ({"file": "file-abc"}, "invalid_request", "file"),
        ({"file_url": "https://example.com/a.wav"}, "unsupported_parameter", "file_url"),
        ({"stream": True}, "unsupported_parameter", "stream"),
        ({"use_beam_search": True}, "unsupported_parameter", "use_beam_search"),
        ({"response_format": "verbose_json"}, "unsupported_parameter", "response_format"),
        ({"response_format": "srt"}, "unsupported_parameter", "response_format"),
        ({"timestamp_granularities[]": ["word"]}, "unsupported_parameter", "timestamp_granularities"),
        ({"n": 2}, "invalid_request", "n"),
        ({"max_completion_tokens": 0}, "invalid_request", "max_completion_tokens"),
        ({"temperature": "hot"}, "invalid_request", "temperature"),
        ({"colour": "red"}, "invalid_request", "colour"),
        ({"model": ""}, "invalid_request", "model"),
    ],
)
def test_what_a_body_may_not_hold_is_refused_naming_the_field(body: dict, code: str, param: str) -> None:
    assert _refusal(body) == (code, param)


def test_audio_is_decoded_to_16_khz_mono() -> None:
    audio = decode(tone(1.5, rate=44_100, channels=2, fmt="FLAC"))
    assert audio.seconds == pytest.approx(1.5) and audio.billed_seconds == 2
    assert audio.samples.dtype == np.float32 and audio.samples.shape == (int(1.5 * SAMPLE_RATE),)
    # the tone survives resampling: its peak is still at 440 Hz
    spectrum = np.abs(np.fft.rfft(audio.samples))
    assert abs(np.argmax(spectrum) * SAMPLE_RATE / len(audio.samples) - 440) < 2
    same = decode(tone(1.0))
    assert same.samples.shape == (SAMPLE_RATE,) and same.billed_seconds == 1
    assert resample(np.ones(4, dtype=np.float32), 8, 16).shape == (8,)


def _audio_error(data: bytes | str, **limits: Any) -> AudioError:
    with pytest.raises(AudioError) as refused:
        if isinstance(data, str):
            decode(data_url_bytes(data, **limits))
        else:
            decode(data, **limits)
    return refused.value


def test_each_kind_of_bad_audio_is_refused_with_its_reason() -> None:
    too_long = _audio_error(tone(3.0), max_seconds=2.5)
    assert too_long.code == "audio_too_long" and "3.0 s long; the limit is 2.5 s" in too_long.message
    assert _audio_error(tone(31.0)).code == "audio_too_long"  # Whisper's 30 s by default
    assert _audio_error(b"RIFF....WAVEfmt nonsense").code == "invalid_audio"
    assert _audio_error(tone(0.5)[:30]).code == "invalid_audio"  # a header cut short
    assert _audio_error(tone(1.0), max_bytes=1000).code == "audio_too_large"
    # a data URL: refused by its size before its base64 is decoded
    huge = "data:audio/wav;base64," + "A" * 4000
    assert _audio_error(huge, max_bytes=1000).code == "audio_too_large"
    assert _audio_error("data:audio/wav,plain").code == "invalid_audio"
    assert _audio_error("data:audio/wav;base64,@@@@").code == "invalid_audio"
    empty = "data:audio/wav;base64," + base64.b64encode(tone(0.0)).decode()
    assert _audio_error(empty).code == "invalid_audio"


def test_the_line_s_audio_error_names_file_url() -> None:
    parsed = parse_body(TRANSCRIPTIONS, {"model": "whisper", "file_url": audio_url(b"noise")})
    with pytest.raises(RequestError) as refused:
        load_audio(parsed.request)
    assert (refused.value.code, refused.value.param) == ("invalid_audio", "file_url")
    assert load_audio(parse_body(TRANSCRIPTIONS, {"file_url": audio_url(tone(0.25))}).request).seconds == 0.25
