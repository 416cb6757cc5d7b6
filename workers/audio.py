"""Audio of a transcription or translation line: a data URL's bytes, decoded to Whisper's input.

Why here and not vLLM's `load_audio`: vLLM decodes with torchcodec, PyAV or soundfile and resamples
with PyAV, scipy, soxr or torchaudio; Freight installs one small decoder (`soundfile`, whose wheels
bundle libsndfile: WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF...) and resamples with numpy's FFT, so no
FFmpeg is needed. MP4, M4A and WebM containers are therefore refused as undecodable.

Memory is bounded before anything is decoded: the encoded bytes are refused past
``max_bytes`` (the data URL's base64 is measured before it is decoded), and the duration is read
from the file's header and refused past ``max_seconds`` before a sample is read. Audio longer than
Whisper's 30 s window is split into chunks by the engine (workers/transcription.py), so the limit
(FREIGHT_MAX_AUDIO_SECONDS) defaults to vLLM's own decode limit, 600 s (VLLM_MAX_AUDIO_DECODE_DURATION_S:
9.6 M samples, 38 MB of float32 for the line while it runs). Every refusal is an ``AudioError``
naming the reason: the line's 400 error.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SAMPLE_RATE = 16_000  # what Whisper's feature extractor takes
MAX_SECONDS = 600.0  # vLLM's decode limit: FREIGHT_MAX_AUDIO_SECONDS' default
MAX_BYTES = 25 * 1024 * 1024  # OpenAI's limit on an audio upload


class AudioError(ValueError):
    """Audio a line cannot be run with: ``code`` is the line's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Audio:
    samples: Any  # float32 mono at SAMPLE_RATE
    seconds: float  # the audio's duration as its file says

    @property
    def billed_seconds(self) -> int:
        """Seconds as OpenAI bills them (and vLLM's usage says): rounded up."""
        return math.ceil(self.seconds)


def data_url_bytes(url: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL, refused past ``max_bytes`` before the
    base64 is decoded."""
    header, sep, data = url.partition(",")
    if not header.startswith("data:") or not sep or not header.endswith(";base64"):
        raise AudioError("invalid_audio", "file_url must be a base64 data URL (data:audio/wav;base64,...)")
    size = len(data.rstrip("=")) * 3 // 4
    if size > max_bytes:
        raise AudioError("audio_too_large", f"the audio is {size} bytes; the limit is {max_bytes}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioError("invalid_audio", f"file_url is not valid base64: {exc}") from None


def _seconds(rate: int, frames: int, max_seconds: float) -> float:
    """The duration a header's rate and frame count give, refused when it holds no samples or
    lasts past ``max_seconds``: the one length check of validation, the dry run and the engine."""
    if rate <= 0 or frames <= 0:
        raise AudioError("invalid_audio", "the audio holds no samples")
    seconds = frames / rate
    if seconds > max_seconds:
        raise AudioError(
            "audio_too_long",
            f"the audio is {seconds:.1f} s long; the limit is {max_seconds:g} s (FREIGHT_MAX_AUDIO_SECONDS)",
        )
    return float(seconds)


def _undecodable(exc: Exception) -> AudioError:
    """libsndfile's errors (an unknown format, a header or file cut short...) as the line's error."""
    return AudioError(
        "invalid_audio", f"the audio could not be decoded (WAV, FLAC, OGG or MP3 expected): {exc}"
    )


def header_seconds(data: bytes, max_seconds: float = MAX_SECONDS) -> float:
    """The audio's duration from its header, no sample decoded: validation's and the dry run's
    check of a line's audio, refused (``AudioError``, the codes ``decode`` gives) when libsndfile
    cannot read the header, it holds no samples or it lasts past ``max_seconds``. Reading only the
    header keeps the check's cost per distinct clip a few kilobytes whatever the clip's length;
    samples that are cut short or damaged past the header are still found when the line runs."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as exc:
        raise _undecodable(exc) from None
    return _seconds(info.samplerate, info.frames, max_seconds)


def decode(data: bytes, max_seconds: float = MAX_SECONDS, max_bytes: int = MAX_BYTES) -> Audio:
    """Encoded audio to float32 mono at 16 kHz; refused past ``max_bytes`` or ``max_seconds``
    (read from the header, before decoding) or when libsndfile cannot read it."""
    import soundfile

    if len(data) > max_bytes:
        raise AudioError("audio_too_large", f"the audio is {len(data)} bytes; the limit is {max_bytes}")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate = f.samplerate
            seconds = _seconds(rate, f.frames, max_seconds)
            samples = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except Exception as exc:
        raise _undecodable(exc) from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return Audio(resample(mono, rate, SAMPLE_RATE).astype(np.float32, copy=False), seconds)


def resample(samples: Any, rate: int, target: int) -> Any:
    """Band-limited resampling by FFT (the spectrum cut or zero-padded to the new length): exact
    for audio already band-limited below both Nyquist rates; bounded by the duration limit."""
    if rate == target or len(samples) == 0:
        return samples
    length = max(1, round(len(samples) * target / rate))
    spectrum = np.fft.rfft(samples)
    bins = length // 2 + 1
    if len(spectrum) >= bins:
        spectrum = spectrum[:bins]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(bins - len(spectrum), dtype=spectrum.dtype)])
    return np.fft.irfft(spectrum, n=length) * (length / len(samples))
