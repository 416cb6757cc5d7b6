"""Audio for transcription and translation tests: a sine tone written as WAV (or FLAC) with
soundfile, as a data URL, in a batch line."""

from __future__ import annotations

import base64
import io
from typing import Any

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"


def tone(
    seconds: float = 1.0, rate: int = 16_000, hz: float = 440.0, channels: int = 1, fmt: str = "WAV"
) -> bytes:
    """``seconds`` of a sine tone at ``rate`` Hz, encoded by libsndfile."""
    import numpy as np
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    samples = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt)
    return out.getvalue()


def audio_url(data: bytes, mime: str = "audio/wav") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def audio_line(
    custom_id: str, data: bytes, *, url: str = TRANSCRIPTIONS, model: str = "whisper", **body: Any
) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, "file_url": audio_url(data), **body},
    }
