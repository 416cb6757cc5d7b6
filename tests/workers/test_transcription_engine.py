"""Transcription and translation lines on vLLM's engine with the demo speech model (a random
Whisper): the decoder prompt vLLM's serving builds over the audio as the encoder's input, language
detection when a line names none, usage by the audio's duration, and each bad audio its own 400
while the other lines run. Random weights: the path is checked, not the text."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.audio_factories import TRANSCRIPTIONS, TRANSLATIONS, audio_url, tone
from workers.engine import Engine, EngineConfig, EngineRequest


def _engine(path: Path) -> Engine:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return Engine.start(
        EngineConfig(
            model_path=str(path),
            served_name="whisper",
            max_num_seqs=8,
            kv_cache_bytes=16 * 1024 * 1024,
            enforce_eager=True,
            task="transcribe",
            max_audio_seconds=50,
        )
    )


def _body(data: bytes | str, **fields: Any) -> dict:
    url = data if isinstance(data, str) else audio_url(data)
    return {"model": "whisper", "file_url": url, "max_completion_tokens": 8, **fields}


def test_audio_lines_run_on_a_whisper_model(whisper_model: Path) -> None:
    engine = _engine(whisper_model)
    lines = {
        "en": (TRANSCRIPTIONS, _body(tone(2.2), language="en")),
        "detected": (TRANSCRIPTIONS, _body(tone(1.0, rate=44_100, channels=2, fmt="FLAC"))),
        "text": (TRANSCRIPTIONS, _body(tone(1.0), language="de", response_format="text", prompt="hello")),
        "translate": (TRANSLATIONS, _body(tone(1.0), language="fr")),
        "too-long": (TRANSCRIPTIONS, _body(tone(51.0), language="en")),
        # past Whisper's 30 s window: two chunks, the second after detection on the first
        "long": (TRANSCRIPTIONS, _body(tone(45.0), language="en")),
        "long-detected": (TRANSLATIONS, _body(tone(45.0))),
        "verbose": (TRANSCRIPTIONS, _body(tone(2.2), language="en", response_format="verbose_json")),
        "verbose-long": (TRANSCRIPTIONS, _body(tone(45.0), response_format="verbose_json")),
        "words": (
            TRANSCRIPTIONS,
            _body(tone(1.0), response_format="verbose_json", timestamp_granularities=["word"]),
        ),
        "noise": (TRANSCRIPTIONS, _body(b"not audio at all", language="en")),
        "bad-language": (TRANSCRIPTIONS, _body(tone(1.0), language="xx")),
        "to-chat": (
            "/v1/chat/completions",
            {"model": "whisper", "messages": [{"role": "user", "content": "hi"}]},
        ),
    }
    try:
        results = {r.key: r for r in engine.run(EngineRequest(k, e, b) for k, (e, b) in lines.items())}
    finally:
        engine.shutdown()
    assert set(results) == set(lines)
    for key in ("en", "detected", "text"):
        result = results[key]
        assert result.ok, (key, result.error)
        assert set(result.body) == {"text", "usage"} and isinstance(result.body["text"], str)
        assert 1 <= result.completion_tokens <= 8
    assert results["en"].body["usage"] == {"type": "duration", "seconds": 3}  # 2.2 s, rounded up
    assert results["detected"].body["usage"] == {"type": "duration", "seconds": 1}
    # the decoder prompt (<|startoftranscript|><|en|><|transcribe|><|notimestamps|>) and 100 log-mel
    # frames a second, as vLLM's streaming usage counts them
    assert results["en"].prompt_tokens == 4 + 220
    assert results["text"].prompt_tokens > 4 + 100  # the prompt's <|prev|> text comes first
    translated = results["translate"]
    assert translated.ok and set(translated.body) == {"text"}, translated
    errors = {k: (r.status_code, r.error["code"], r.error["param"]) for k, r in results.items() if not r.ok}
    assert errors == {
        "too-long": (400, "audio_too_long", "file_url"),
        "noise": (400, "invalid_audio", "file_url"),
        "bad-language": (400, "invalid_request", "language"),
        "to-chat": (400, "invalid_model", "model"),
        "words": (400, "unsupported_parameter", "timestamp_granularities"),
    }
    assert "51.0 s long; the limit is 50 s" in results["too-long"].error["message"]
    long = results["long"]
    assert long.ok and long.body["usage"] == {"type": "duration", "seconds": 45}
    # each chunk's decoder prompt and its frames: 2 x 4 + 4,500 (a frame may round up per chunk)
    assert 8 + 4500 <= long.prompt_tokens <= 8 + 4502
    assert 2 <= long.completion_tokens <= 16  # 8 a chunk at most, as vLLM's serving budgets
    detected = results["long-detected"]
    assert detected.ok and set(detected.body) == {"text"} and 2 <= detected.completion_tokens <= 16
    for key, seconds in (("verbose", 2.2), ("verbose-long", 45.0)):
        body = results[key].body
        assert results[key].ok and set(body) == {"text", "language", "duration", "segments", "usage"}, key
        assert body["duration"] == seconds and isinstance(body["language"], str)
        joiner = "" if body["language"] in ("ja", "zh") else " "  # vLLM's: no spaces for these
        assert body["text"] == joiner.join(s["text"] for s in body["segments"])
        for segment in body["segments"]:  # random weights: as many as the tokens drawn make
            assert 0 <= segment["start"] <= segment["end"] <= seconds + 30
    assert results["verbose"].body["language"] == "en"
    # each segment's no_speech_prob is Whisper's: the no-speech token's probability right after the
    # start token over its chunk, here against transformers' own forward pass over the same audio
    expected = _hf_no_speech(whisper_model, tone(2.2))
    probs = {round(s["no_speech_prob"], 9) for s in results["verbose"].body["segments"]}
    assert len(probs) == 1 and abs(probs.pop() / expected["<|nospeech|>"] - 1) < 0.02, (probs, expected)
    assert abs(expected["<|nospeech|>"] / expected["other"] - 1) > 0.02  # another token's is told apart
    assert all(0 < s["no_speech_prob"] < 1 for s in results["verbose-long"].body["segments"])
    assert errors["words"] == (400, "unsupported_parameter", "timestamp_granularities")


def _hf_no_speech(path: Path, wav: bytes) -> dict[str, float]:
    """transformers' probabilities after <|startoftranscript|> over ``wav``: of the no-speech
    token, and of another token (the one before it) to show the comparison discriminates."""
    import io

    import soundfile
    import torch
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    features = WhisperFeatureExtractor.from_pretrained(path)(samples, sampling_rate=rate, return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(path)
    start, no_speech = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|nospeech|>"])
    model = WhisperForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(
            input_features=features.input_features, decoder_input_ids=torch.tensor([[start]])
        ).logits
    probs = torch.softmax(logits[0, -1].float(), dim=-1)
    return {"<|nospeech|>": float(probs[no_speech]), "other": float(probs[no_speech - 1])}
