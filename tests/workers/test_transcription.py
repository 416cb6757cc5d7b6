"""Transcription and translation bodies (vLLM run-batch's shapes: the audio in `file_url`, a data
URL) and their audio: what validation accepts or refuses naming the field, and each kind of bad
audio the line's own error (too large, too long, undecodable), decoded to Whisper's 16 kHz mono."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
import pytest

from tests.audio_factories import TRANSCRIPTIONS, TRANSLATIONS, audio_line, audio_url, tone
from workers.audio import SAMPLE_RATE, Audio, AudioError, data_url_bytes, decode, resample
from workers.request_bodies import RequestError, endpoint_mismatch, parse_body, serves
from workers.transcription import SpeechModel, TranscribedLine, load_audio, speech_chunks
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
    verbose = {"file_url": audio_url(tone(0.1)), "response_format": "verbose_json"}
    for body in (verbose, {**verbose, "timestamp_granularities": ["segment"]}):
        assert parse_body(TRANSCRIPTIONS, body).request.request.response_format == "verbose_json"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"file_url": None}, "invalid_request", "file_url"),
        ({"file_url": 7}, "invalid_request", "file_url"),
        ({"file": "file-abc"}, "invalid_request", "file"),
        ({"file_url": "https://example.com/a.wav"}, "unsupported_parameter", "file_url"),
        ({"stream": True}, "unsupported_parameter", "stream"),
        ({"use_beam_search": True}, "unsupported_parameter", "use_beam_search"),
        ({"response_format": "srt"}, "unsupported_parameter", "response_format"),
        ({"response_format": "vtt"}, "unsupported_parameter", "response_format"),
        ({"timestamp_granularities[]": ["word"]}, "unsupported_parameter", "timestamp_granularities"),
        (
            {"timestamp_granularities": ["word"], "response_format": "verbose_json"},
            "unsupported_parameter",
            "timestamp_granularities",
        ),
        ({"timestamp_granularities": ["segment"]}, "unsupported_parameter", "timestamp_granularities"),
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
    assert decode(tone(31.0)).seconds == 31.0  # past Whisper's window: the engine splits it
    assert _audio_error(tone(601.0, rate=800)).code == "audio_too_long"  # vLLM's 600 s by default
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


def test_long_audio_is_split_as_vllm_s_serving_splits_it() -> None:
    from vllm.config.speech_to_text import SpeechToTextConfig

    config = SpeechToTextConfig()  # Whisper's: 30 s clips, cut in the last second's quietest 100 ms
    samples = decode(tone(45.0)).samples
    samples[int(29.4 * SAMPLE_RATE) : int(29.5 * SAMPLE_RATE)] = 0.0  # a pause to cut at
    chunks = speech_chunks(samples, config)
    assert [len(c) for c in chunks] == [int(29.4 * SAMPLE_RATE), int(15.6 * SAMPLE_RATE)]
    assert np.array_equal(np.concatenate(chunks), samples)
    assert len(speech_chunks(samples[: 30 * SAMPLE_RATE], config)) == 1
    unsplit = SpeechToTextConfig(min_energy_split_window_size=None)
    with pytest.raises(RequestError) as refused:
        speech_chunks(samples, unsplit)
    assert (refused.value.code, refused.value.param) == ("audio_too_long", "file_url")
    assert "45.0 s long; this model takes at most 30 s" in refused.value.message


def test_verbose_json_segments_are_vllm_s_offset_by_each_chunk(whisper_model) -> None:
    """Two chunks (30 s and 15 s) answered with Whisper's timestamp tokens: vLLM's segments of
    each, the second's times from its chunk's start, numbered across the line, the text theirs."""
    from openai.types.audio import TranscriptionVerbose
    from transformers import AutoTokenizer
    from vllm.config.speech_to_text import SpeechToTextConfig
    from vllm.logprobs import Logprob
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration
    from vllm.outputs import CompletionOutput, RequestOutput

    tokenizer = AutoTokenizer.from_pretrained(whisper_model)
    zero = tokenizer.encode("<|0.00|>", add_special_tokens=False)[0]

    def at(seconds: float) -> int:
        return zero + round(seconds / 0.02)

    def words(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def output(request_id: str, tokens: list[int]) -> RequestOutput:
        logprobs = [{t: Logprob(-0.5)} for t in tokens]
        done = CompletionOutput(0, "", tokens, None, logprobs, finish_reason="stop")
        return RequestOutput(request_id, None, [], None, [done], finished=True)

    speech = SpeechModel(
        WhisperForConditionalGeneration, None, tokenizer, {"transcribe": SpeechToTextConfig()}
    )
    body = parse_body(
        TRANSCRIPTIONS,
        {"file_url": audio_url(tone(0.1)), "response_format": "verbose_json", "temperature": 0.2},
    ).request
    samples = np.zeros(45 * SAMPLE_RATE, dtype=np.float32)
    chunks = [samples[: 30 * SAMPLE_RATE], samples[30 * SAMPLE_RATE :]]
    line = TranscribedLine(body, Audio(samples, 45.0), speech, 8, {}, ["a", "a-1"], chunks, language="en")
    line.chunk_ids = ["a", "a-1"]
    eos = tokenizer.eos_token_id
    assert not line.collect(output("a", [*words("hi"), at(1.0), at(1.0), *words("yo"), at(2.5), eos]))
    assert line.collect(output("a-1", [*words("ok"), at(3.0), eos]))
    response, completion_tokens = line.response()
    spans = [(s["id"], s["start"], s["end"], s["text"]) for s in response["segments"]]
    assert spans == [(0, 0.0, 1.0, "hi"), (1, 1.0, 2.5, "yo"), (2, 30.0, 33.0, "ok")]
    first = response["segments"][0]
    assert first["tokens"] == words("hi") and first["avg_logprob"] < 0 and first["temperature"] == 0.2
    assert response["text"] == "hi yo ok" and response["language"] == "en" and response["duration"] == 45.0
    assert response["usage"] == {"type": "duration", "seconds": 45}
    assert {s["no_speech_prob"] for s in response["segments"]} == {0.0}  # no probe: the type needs one
    assert TranscriptionVerbose.model_validate(response).segments[2].start == 30.0  # the client's type
    assert completion_tokens == len(words("hi") + words("yo") + words("ok")) + 4 + 2  # stamps, ends

    # with the model's no-speech token, each chunk's probe: the line waits for them too, and each
    # segment takes its chunk's probability (vLLM's log-probability of the probe's one token)
    no_speech = tokenizer.convert_tokens_to_ids("<|nospeech|>")
    speech.no_speech_token = no_speech
    probed = TranscribedLine(body, Audio(samples, 45.0), speech, 8, {}, [], chunks, language="en")
    probed.chunk_ids, probed.probe_ids = ["b", "b-1"], ["b-nospeech-0", "b-nospeech-1"]

    def probe(request_id: str, logprob: float) -> RequestOutput:
        done = CompletionOutput(
            0, "", [no_speech], None, [{no_speech: Logprob(logprob)}], finish_reason="length"
        )
        return RequestOutput(request_id, None, [], None, [done], finished=True)

    assert not probed.collect(output("b", [*words("hi"), at(1.0), eos]))
    assert not probed.collect(probe("b-nospeech-1", -3.0))
    assert not probed.collect(output("b-1", [*words("ok"), at(3.0), eos]))
    assert probed.collect(probe("b-nospeech-0", -0.25))
    segments = probed.response()[0]["segments"]
    assert [round(s["no_speech_prob"], 6) for s in segments] == [
        round(math.exp(-0.25), 6),
        round(math.exp(-3.0), 6),
    ]
