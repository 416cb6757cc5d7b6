"""Transcription and translation lines: /v1/audio/transcriptions and /v1/audio/translations on a
Whisper-architecture model (registry task "transcribe").

Why vLLM's own pieces: a line's body is checked by the request classes of vLLM's run-batch
(`BatchTranscriptionRequest`, `BatchTranslationRequest`: OpenAI's fields with the audio in
`file_url`, a data URL), so a line accepts what `vllm run-batch` accepts; the prompt is the model
class's own (`get_generation_prompt`: Whisper's `<|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>` decoder prompt over the audio as the encoder's multimodal input), rendered by the
engine's renderer, as vLLM's speech-to-text serving builds it. A line without `language` first
runs vLLM's language detection (one token, constrained to the language tokens), then the
transcription: two engine requests in turn.

What a batch line cannot have, refused as the line's unsupported_parameter: streaming, beam search,
`response_format` other than json or text (verbose_json's segments, srt, vtt), timestamp
granularities, audio longer than Whisper's 30 s window (Freight does not split audio). The answer
is OpenAI's (and vLLM's) shape: a transcription `{"text": ..., "usage": {"type": "duration",
"seconds": N}}` (seconds rounded up, as OpenAI bills them), a translation `{"text": ...}`;
`response_format: "text"` answers the same JSON, as vLLM's run-batch does. Engine usage: prompt
tokens are the decoder prompt's plus the audio's log-mel frames (100 a second), as vLLM's streaming
usage counts them; completion tokens are those generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.audio import MAX_BYTES, MAX_SECONDS, Audio, AudioError, data_url_bytes, decode
from workers.request_errors import RequestError, clip_message

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
AUDIO_ENDPOINTS = (TRANSCRIPTIONS, TRANSLATIONS)
RESPONSE_FORMATS = ("json", "text")
_UNSUPPORTED = "unsupported_parameter"


@dataclass(frozen=True)
class AudioBody:
    """A checked transcription or translation body: vLLM's request object (its sampling fields)
    and the audio's data URL, not yet decoded."""

    endpoint: str
    request: Any  # vLLM's BatchTranscriptionRequest or BatchTranslationRequest
    file_url: str

    @property
    def task(self) -> str:
        return "translate" if self.endpoint == TRANSLATIONS else "transcribe"


def audio_request_class(endpoint: str, data: dict, validated: bool = False) -> tuple[Any, str | None]:
    """vLLM's run-batch request class for ``endpoint`` once the fields vLLM would take but a batch
    line cannot honour are refused; the body's model name. ``file_url`` is a data URL or, past
    vLLM's shape, the id of a file the tenant uploaded (``file-...``, resolved at validation by
    ``workers.media_files``); in a body validation stored (``validated``) a file id has become the
    reference to the stored audio."""
    from vllm.entrypoints.launchers.run_batch import BatchTranscriptionRequest, BatchTranslationRequest

    from workers.media_files import is_audio_ref

    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise RequestError("invalid_request", "`model` must be a non-empty string.", "model")
    if "file" in data:
        raise RequestError(
            "invalid_request",
            "`file` is not accepted in a batch line: give the audio as `file_url`, a base64 data URL"
            " (data:audio/wav;base64,...), as vLLM's run-batch does.",
            "file",
        )
    url = data.get("file_url")
    if not isinstance(url, str) or not url:
        raise RequestError(
            "invalid_request", "`file_url` (the audio as a data URL or a file id) is required.", "file_url"
        )
    by_file = is_audio_ref(url) if validated else url.startswith("file-")
    if not url.startswith("data:") and not by_file:
        raise RequestError(
            _UNSUPPORTED,
            "`file_url` must be a data URL or the id of a file uploaded with purpose vision or"
            " user_data; remote audio is not fetched.",
            "file_url",
        )
    for name in ("stream", "stream_include_usage", "stream_continuous_usage_stats", "use_beam_search"):
        if data.get(name):
            raise RequestError(_UNSUPPORTED, f"`{name}` is not available in batch requests.", name)
    if data.get("response_format", "json") not in RESPONSE_FORMATS:
        raise RequestError(
            _UNSUPPORTED,
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)} in a batch line.",
            "response_format",
        )
    if data.get("timestamp_granularities[]") or data.get("timestamp_granularities"):
        raise RequestError(
            _UNSUPPORTED, "timestamp granularities are not supported.", "timestamp_granularities"
        )
    return (BatchTranslationRequest if endpoint == TRANSLATIONS else BatchTranscriptionRequest), model


def audio_body(endpoint: str, request: Any) -> AudioBody:
    """The checked body; `n` past 1 means nothing without beam search and is refused."""
    if (request.n or 1) != 1:
        raise RequestError("invalid_request", "`n` must be 1 for audio lines.", "n")
    if request.max_completion_tokens is not None and request.max_completion_tokens < 1:
        raise RequestError(
            "invalid_request", "`max_completion_tokens` must be at least 1.", "max_completion_tokens"
        )
    return AudioBody(endpoint, request, request.file_url)


def load_audio(
    body: AudioBody,
    max_seconds: float = MAX_SECONDS,
    max_bytes: int = MAX_BYTES,
    read: Callable[[str], bytes] | None = None,
) -> Audio:
    """The line's audio decoded; raises RequestError naming `file_url` (too large, too long,
    undecodable). ``read``: the stored bytes of a reference validation wrote for a file id
    (``workers.media_files.read_audio_ref`` of the line's batch)."""
    from workers.media_files import is_audio_ref

    try:
        if is_audio_ref(body.file_url):
            if read is None:
                raise RequestError("internal_error", "no reader for stored audio", "file_url", 500)
            return decode(read(body.file_url), max_seconds, max_bytes)
        return decode(data_url_bytes(body.file_url, max_bytes), max_seconds, max_bytes)
    except AudioError as exc:
        raise RequestError(exc.code, clip_message(exc.message), "file_url") from None


class TranscriptionFailed(RuntimeError):
    """vLLM failed the line's request."""


@dataclass
class SpeechModel:
    """What the engine needs of its Whisper model once: vLLM's model class and its speech config."""

    model_cls: Any
    model_config: Any
    tokenizer: Any
    configs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, llm: Any) -> SpeechModel:
        from vllm.model_executor.model_loader import get_model_cls

        return cls(get_model_cls(llm.model_config), llm.model_config, llm.get_tokenizer())

    def config(self, task: str) -> Any:
        if task not in self.configs:
            self.configs[task] = self.model_cls.get_speech_to_text_config(self.model_config, task)
        return self.configs[task]


@dataclass
class TranscribedLine:
    """One audio line in the engine: an optional language detection, then the transcription."""

    body: AudioBody
    audio: Audio
    speech: SpeechModel
    max_tokens: int | None  # the line's budget; None: the context left
    default_sampling: dict[str, Any]
    request_ids: list[str]
    language: str | None = None
    prompt_tokens: int = 0
    output: Any = None

    def detection(self, renderer: Any) -> tuple[Any, Any]:
        """vLLM's language detection request: Whisper's start token over the audio, one token
        drawn from the language tokens."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import SamplingParams

        speech = self.speech
        prompt = speech.model_cls.get_language_detection_prompt(
            self.audio.samples, speech.config(self.body.task)
        )
        (engine_input,) = renderer.render_cmpl([parse_model_prompt(speech.model_config, prompt)])
        allowed = speech.model_cls.get_language_token_ids(speech.tokenizer)
        return engine_input, SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=allowed)

    def transcription(self, renderer: Any, max_model_len: int) -> tuple[Any, Any]:
        """The engine input and sampling parameters of the transcription (or translation) itself."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        request, speech = self.body.request, self.speech
        request.language = self.language
        config = speech.config(self.body.task)
        params = request.build_stt_params(self.audio.samples, config, speech.model_config, self.body.task)
        prompt = parse_model_prompt(speech.model_config, speech.model_cls.get_generation_prompt(params))
        (engine_input,) = renderer.render_cmpl([prompt])
        decoder = engine_input.get("decoder_prompt", engine_input)
        prompt_ids = decoder.get("prompt_token_ids") or []
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError("context_length_exceeded", "The prompt leaves no room to write.", "prompt")
        wanted = request.max_completion_tokens or self.max_tokens or room
        audio_tokens = speech.model_cls.get_num_audio_tokens(self.audio.seconds, config, speech.model_config)
        self.prompt_tokens = len(prompt_ids) + (audio_tokens or 0)
        return engine_input, request.to_sampling_params(min(wanted, room), self.default_sampling)

    def detected(self, output: Any) -> None:
        """The detection's answer: the language the transcription runs in."""
        token_ids = list(output.outputs[0].token_ids) if output.outputs else []
        if not token_ids:
            raise TranscriptionFailed("The engine failed while detecting this audio's language.")
        self.language = self.speech.model_cls.parse_language_detection_output(
            token_ids, self.speech.tokenizer
        )

    def response(self) -> tuple[dict[str, Any], int]:
        """The line's response body and its completion tokens; raises TranscriptionFailed."""
        output = self.output
        if output is None or not output.outputs or output.outputs[0].finish_reason == "error":
            raise TranscriptionFailed("The engine failed while transcribing this request.")
        completion = output.outputs[0]
        text = self.speech.model_cls.post_process_output(completion.text)
        body: dict[str, Any] = {"text": text}
        if self.body.endpoint == TRANSCRIPTIONS:  # vLLM gives a translation no usage
            body["usage"] = {"type": "duration", "seconds": self.audio.billed_seconds}
        return body, len(completion.token_ids)


def check_language(body: AudioBody, speech: SpeechModel) -> None:
    """A language the model knows (vLLM's check), else the line's invalid_request naming it."""
    for name in ("language", "to_language"):
        value = getattr(body.request, name)
        if value is None:
            continue
        try:
            speech.model_cls.validate_language(value)
        except ValueError as exc:
            raise RequestError("invalid_request", clip_message(str(exc)), name) from None


class SpeechLines:
    """A speech engine's audio lines into vLLM: each line's first request (the language
    detection when the line names no language and the model detects, else the transcription) and,
    once its language is known, the transcription. The engine keeps its own bookkeeping (request
    ids, what is in flight); this holds what only audio lines need: the model's speech class, read
    at the first line, and the engine's limits."""

    def __init__(
        self,
        llm: Any,
        max_seconds: float,
        max_tokens: int | None,
        default_sampling: dict[str, Any],
        max_model_len: int,
    ) -> None:
        self._llm = llm
        self._max_seconds = max_seconds
        self._max_tokens = max_tokens
        self._default_sampling = default_sampling
        self._max_model_len = max_model_len
        self._speech: SpeechModel | None = None

    def submit(
        self, body: AudioBody, request_id: str, read: Callable[[str], bytes] | None = None
    ) -> TranscribedLine:
        """The line's audio decoded (a bad one is the line's fault) and its first request added to
        the engine as ``request_id`` (``-language`` appended for a detection); raises RequestError
        for the line's fault. ``read``: see ``load_audio``."""
        if self._speech is None:
            self._speech = SpeechModel.of(self._llm)
        check_language(body, self._speech)
        audio = load_audio(body, self._max_seconds, read=read)
        line = TranscribedLine(body, audio, self._speech, self._max_tokens, self._default_sampling, [])
        line.language = body.request.language
        detects = getattr(self._speech.model_cls, "supports_explicit_language_detection", False)
        if line.language is None and detects:
            prompt, params = line.detection(self._llm.renderer)
            request_id += "-language"
        else:
            prompt, params = line.transcription(self._llm.renderer, self._max_model_len)
        self._llm.add_request(request_id, prompt, params)
        line.request_ids.append(request_id)
        return line

    def transcribe(self, line: TranscribedLine, detection: Any, request_id: str) -> None:
        """A line whose language detection finished (vLLM's output ``detection``): its
        transcription added to the engine as ``request_id``; raises RequestError for the line's
        fault, TranscriptionFailed when the detection answered nothing."""
        line.detected(detection)
        prompt, params = line.transcription(self._llm.renderer, self._max_model_len)
        self._llm.add_request(request_id, prompt, params)
        line.request_ids.append(request_id)
