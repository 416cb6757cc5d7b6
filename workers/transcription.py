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

Audio longer than the model's clip (Whisper's 30 s window: its speech config's
`max_audio_clip_s`) is split as vLLM's speech-to-text serving splits it (`split_audio`: chunks of
at most 30 s, each cut at the quietest 100 ms of its last second), each chunk one engine request
(its own decoder prompt over the chunk, the same `max_completion_tokens` each, as vLLM's), the
language detected once on the first chunk, and the texts joined by vLLM's separator (a space; none
for Chinese and Japanese). A model whose config allows no chunking refuses such audio as the line's
audio_too_long.

`response_format: "verbose_json"` is vLLM's: the decoder prompt asks for timestamps (`<|0.00|>`
instead of `<|notimestamps|>`), each chunk's tokens with their log-probabilities become segments
(`start`, `end` in seconds from the audio's start, `text`, `tokens`, `avg_logprob`,
`compression_ratio`, `temperature`, and `no_speech_prob`: the chunk's, as Whisper defines it, the
probability of its no-speech token right after the start token over that audio. vLLM computes
none, so each chunk of a verbose line gets a probe request of its own: the start token alone over
the chunk, one token allowed (the no-speech token), whose log-probability vLLM reports before that
restriction (its default `raw_logprobs`), so it is the model's own over its whole vocabulary. A
model with no such token gives 0.0, as OpenAI's type needs a number), the text is the
segments' joined, and the body carries `language` and `duration`, plus OpenAI's duration `usage`
for a transcription. Only a model class with segment timestamps (`supports_segment_timestamp`:
Whisper) takes it; another refuses the line. Word timestamps (`timestamp_granularities` holding
`word`) are not available (vLLM computes none); `["segment"]` with verbose_json is what it gives.

What a batch line cannot have, refused as the line's unsupported_parameter: streaming, beam search,
`response_format` srt or vtt, word timestamps. The answer is OpenAI's (and vLLM's) shape: a
transcription `{"text": ..., "usage": {"type": "duration", "seconds": N}}` (seconds rounded up,
as OpenAI bills them), a translation `{"text": ...}`; `response_format: "text"` answers the same
JSON, as vLLM's run-batch does. Engine usage: prompt tokens are each chunk's decoder prompt plus
its log-mel frames (100 a second), as vLLM's streaming usage counts them; completion tokens are
those generated, all chunks together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from workers.audio import MAX_BYTES, MAX_SECONDS, Audio, AudioError, data_url_bytes, decode
from workers.request_errors import RequestError, clip_message

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
AUDIO_ENDPOINTS = (TRANSCRIPTIONS, TRANSLATIONS)
RESPONSE_FORMATS = ("json", "text", "verbose_json")
VERBOSE = "verbose_json"
# Whisper's no-speech token: its name in current vocabularies, then in the first models'
NO_SPEECH_TOKENS = ("<|nospeech|>", "<|nocaptions|>")
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
    _check_granularities(data)
    return (BatchTranslationRequest if endpoint == TRANSLATIONS else BatchTranscriptionRequest), model


def _check_granularities(data: dict) -> None:
    """Segment timestamps with verbose_json (what it gives anyway); word timestamps are refused."""
    for name in ("timestamp_granularities[]", "timestamp_granularities"):
        wanted = data.get(name)
        if not wanted:
            continue
        param = "timestamp_granularities"
        if data.get("response_format") != VERBOSE:
            raise RequestError(
                _UNSUPPORTED, "timestamp granularities need response_format verbose_json.", param
            )
        if wanted != ["segment"]:
            raise RequestError(
                _UNSUPPORTED,
                'only ["segment"] timestamp granularities are available: no word timestamps.',
                param,
            )


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
    no_speech_token: int | None = None  # <|nospeech|> (<|nocaptions|> in older vocabularies)

    @classmethod
    def of(cls, llm: Any) -> SpeechModel:
        from vllm.model_executor.model_loader import get_model_cls

        tokenizer = llm.get_tokenizer()
        return cls(
            get_model_cls(llm.model_config),
            llm.model_config,
            tokenizer,
            no_speech_token=_no_speech_token(tokenizer),
        )

    def config(self, task: str) -> Any:
        if task not in self.configs:
            self.configs[task] = self.model_cls.get_speech_to_text_config(self.model_config, task)
        return self.configs[task]


def _no_speech_token(tokenizer: Any) -> int | None:
    """Whisper's no-speech token's id in this vocabulary, None when it has none."""
    for name in NO_SPEECH_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            return token_id
    return None


def chunks_at_most(seconds: float, clip: float = 30.0, overlap: float = 1.0) -> int:
    """How many chunks ``speech_chunks`` makes of this much audio at most, Whisper's clip and
    overlap by default (each chunk but the last is at least ``clip - overlap`` long): what a dry
    run, reading only the audio's header, prices."""
    if seconds <= clip:
        return 1
    return 1 + math.ceil((seconds - clip) / (clip - overlap))


def speech_chunks(samples: Any, config: Any) -> list[Any]:
    """The audio as the engine's requests take it: whole within the model's clip
    (``max_audio_clip_s``), else split as vLLM's speech-to-text serving splits it; a model whose
    config allows no chunking refuses longer audio (the line's audio_too_long)."""
    clip = config.max_audio_clip_s
    seconds = len(samples) / config.sample_rate
    if clip is None or seconds <= clip:
        return [samples]
    if not config.allow_audio_chunking:
        raise RequestError(
            "audio_too_long",
            f"the audio is {seconds:.1f} s long; this model takes at most {clip} s and splits no audio",
            "file_url",
        )
    from vllm.multimodal.audio import split_audio

    return split_audio(
        audio_data=samples,
        sample_rate=int(config.sample_rate),
        max_clip_duration_s=clip,
        overlap_duration_s=config.overlap_chunk_second,
        min_energy_window_size=config.min_energy_split_window_size,
    )


@dataclass
class TranscribedLine:
    """One audio line in the engine: an optional language detection on its first chunk, then one
    transcription request per chunk (``chunks``: the audio split at the model's clip length)."""

    body: AudioBody
    audio: Audio
    speech: SpeechModel
    max_tokens: int | None  # each chunk's budget; None: the context left
    default_sampling: dict[str, Any]
    request_ids: list[str]
    chunks: list[Any] = field(default_factory=list)  # float32 sample arrays (views of the audio's)
    language: str | None = None
    detecting: bool = False  # its language detection is the request in the engine
    prompt_tokens: int = 0
    chunk_ids: list[str] = field(default_factory=list)  # the transcription requests, in chunk order
    probe_ids: list[str] = field(default_factory=list)  # verbose: each chunk's no-speech probe, in order
    outputs: dict[str, Any] = field(default_factory=dict)  # vLLM's finished outputs by request id

    @property
    def verbose(self) -> bool:
        return self.body.request.response_format == VERBOSE

    def detection(self, renderer: Any) -> tuple[Any, Any]:
        """vLLM's language detection request: Whisper's start token over the first chunk, one token
        drawn from the language tokens."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import SamplingParams

        speech = self.speech
        prompt = speech.model_cls.get_language_detection_prompt(self.chunks[0], speech.config(self.body.task))
        (engine_input,) = renderer.render_cmpl([parse_model_prompt(speech.model_config, prompt)])
        allowed = speech.model_cls.get_language_token_ids(speech.tokenizer)
        return engine_input, SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=allowed)

    def transcriptions(self, renderer: Any, max_model_len: int) -> list[tuple[Any, Any]]:
        """The engine input and sampling parameters of each chunk's transcription (or
        translation), as vLLM's serving builds them; the line's prompt tokens counted."""
        from vllm.renderers.inputs.preprocess import parse_enc_dec_prompt, parse_model_prompt

        request, speech = self.body.request, self.speech
        request.language = self.language
        config = speech.config(self.body.task)
        prompts = []
        for chunk in self.chunks:
            params = request.build_stt_params(chunk, config, speech.model_config, self.body.task)
            prompt = speech.model_cls.get_generation_prompt(params)
            if self.verbose:  # vLLM's: the decoder prompt asks for timestamps
                prompts.append(_verbose_prompt(parse_enc_dec_prompt(prompt)))
            else:
                prompts.append(parse_model_prompt(speech.model_config, prompt))
        inputs = renderer.render_cmpl(prompts)
        self.prompt_tokens = 0
        room = max_model_len
        for engine_input, chunk in zip(inputs, self.chunks, strict=True):
            decoder = engine_input.get("decoder_prompt", engine_input)
            prompt_ids = decoder.get("prompt_token_ids") or []
            room = min(room, max_model_len - len(prompt_ids))
            seconds = len(chunk) / config.sample_rate
            audio_tokens = speech.model_cls.get_num_audio_tokens(seconds, config, speech.model_config)
            self.prompt_tokens += len(prompt_ids) + (audio_tokens or 0)
        if room < 1:
            raise RequestError("context_length_exceeded", "The prompt leaves no room to write.", "prompt")
        wanted = request.max_completion_tokens or self.max_tokens or room
        sampling = request.to_sampling_params(min(wanted, room), self.default_sampling)
        if self.verbose:
            sampling.logprobs = 1  # each token's, for the segments' avg_logprob
        return [(engine_input, sampling) for engine_input in inputs]

    def no_speech_probes(self, renderer: Any) -> list[tuple[Any, Any]]:
        """A verbose line's probe per chunk (none otherwise, or for a model without the token):
        the start token alone over the chunk, the no-speech token the one token allowed, its
        log-probability reported (the chunk's ``no_speech_prob``, see the module docstring)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import SamplingParams

        speech = self.speech
        if not self.verbose or speech.no_speech_token is None:
            return []
        config = speech.config(self.body.task)
        prompts = [
            parse_model_prompt(
                speech.model_config, speech.model_cls.get_language_detection_prompt(chunk, config)
            )
            for chunk in self.chunks
        ]
        params = SamplingParams(
            max_tokens=1, temperature=0.0, allowed_token_ids=[speech.no_speech_token], logprobs=0
        )
        return [(engine_input, params) for engine_input in renderer.render_cmpl(prompts)]

    def detected(self, output: Any) -> None:
        """The detection's answer: the language the transcription runs in."""
        self.detecting = False
        token_ids = list(output.outputs[0].token_ids) if output.outputs else []
        if not token_ids:
            raise TranscriptionFailed("The engine failed while detecting this audio's language.")
        self.language = self.speech.model_cls.parse_language_detection_output(
            token_ids, self.speech.tokenizer
        )

    def collect(self, output: Any) -> bool:
        """A finished request of the line; True when the engine has what it waits for: the language
        detection's answer (the transcriptions go in next) or the last chunk's transcription."""
        if self.detecting:
            return True
        self.outputs[output.request_id] = output
        return len(self.outputs) >= len(self.chunk_ids) + len(self.probe_ids)

    def response(self) -> tuple[dict[str, Any], int]:
        """The line's response body and its completion tokens; raises TranscriptionFailed."""
        outputs = [self.outputs.get(request_id) for request_id in self.chunk_ids]
        completions = []
        for output in outputs:
            if output is None or not output.outputs or output.outputs[0].finish_reason == "error":
                raise TranscriptionFailed("The engine failed while transcribing this request.")
            completions.append(output.outputs[0])
        model_cls = self.speech.model_cls
        separator = "" if (self.language or "").lower() in model_cls.no_space_languages else " "
        body: dict[str, Any]
        if self.verbose:
            segments = self._segments(completions)
            body = {
                "text": separator.join(segment["text"] for segment in segments),
                "language": self.language,
                "duration": self.audio.seconds,
                "segments": segments,
            }
        else:
            body = {"text": separator.join(model_cls.post_process_output(c.text) for c in completions)}
        if self.body.endpoint == TRANSCRIPTIONS:  # vLLM gives a translation no usage
            body["usage"] = {"type": "duration", "seconds": self.audio.billed_seconds}
        return body, sum(len(c.token_ids) for c in completions)

    def _no_speech_prob(self, index: int) -> float:
        """Chunk ``index``'s no-speech probability from its probe; 0.0 without one."""
        token_id = self.speech.no_speech_token
        if index >= len(self.probe_ids) or token_id is None:
            return 0.0
        logprob = _probe_logprob(self.outputs.get(self.probe_ids[index]), token_id)
        if logprob is None:
            raise TranscriptionFailed("The engine failed while probing this audio for speech.")
        return math.exp(logprob)

    def _segments(self, completions: list[Any]) -> list[dict[str, Any]]:
        """Each chunk's timestamped segments as vLLM's serving makes them
        (``_get_verbose_segments``, a method reading only ``self.tokenizer``), offset by the
        chunk's start and numbered across the line."""
        from vllm.entrypoints.speech_to_text.base.serving import SpeechToTextBaseServing
        from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionSegment
        from vllm.entrypoints.speech_to_text.translation.protocol import TranslationSegment

        serving = SimpleNamespace(tokenizer=self.speech.tokenizer)
        segment_class = TranslationSegment if self.body.endpoint == TRANSLATIONS else TranscriptionSegment
        segments: list[dict[str, Any]] = []
        start = 0.0
        for index, (completion, chunk) in enumerate(zip(completions, self.chunks, strict=True)):
            no_speech = self._no_speech_prob(index)
            tokens = tuple(completion.token_ids)
            if tokens and tokens[-1] == self.speech.tokenizer.eos_token_id:
                tokens = tokens[:-1]
            if tokens and completion.logprobs:  # vLLM's reads past an empty answer
                made = SpeechToTextBaseServing._get_verbose_segments(
                    serving,
                    tokens=tokens,
                    log_probs=completion.logprobs,
                    request=self.body.request,
                    segment_class=segment_class,
                    start_time=start,
                )
                for segment in made:
                    segment.id = len(segments)
                    segment.no_speech_prob = no_speech
                    segments.append(segment.model_dump(mode="json"))
            start += len(chunk) / self.speech.config(self.body.task).sample_rate
        return segments


def _probe_logprob(output: Any, token_id: int) -> float | None:
    """The log-probability vLLM reported for ``token_id`` as a probe's one token, None if none."""
    completion = output.outputs[0] if output is not None and output.outputs else None
    if completion is None or completion.finish_reason == "error" or not completion.logprobs:
        return None
    found = completion.logprobs[0].get(token_id)
    return None if found is None else float(found.logprob)


def _verbose_prompt(prompt: Any) -> Any:
    """vLLM's verbose_json decoder prompt: timestamps asked for (``<|0.00|>`` where the plain
    prompt has ``<|notimestamps|>``), as its serving's ``_preprocess_verbose_prompt`` does."""
    decoder = prompt["decoder_prompt"]
    if not (isinstance(decoder, dict) and "prompt" in decoder):
        raise RequestError("invalid_request", "verbose_json needs a text decoder prompt", "response_format")
    decoder["prompt"] = decoder["prompt"].replace("<|notimestamps|>", "<|0.00|>")
    return prompt


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


def check_format(body: AudioBody, speech: SpeechModel) -> None:
    """verbose_json only where the model writes segment timestamps (vLLM's check)."""
    if body.request.response_format == VERBOSE and not getattr(
        speech.model_cls, "supports_segment_timestamp", False
    ):
        raise RequestError(
            _UNSUPPORTED, "this model writes no timestamps: verbose_json is not available.", "response_format"
        )


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
        check_format(body, self._speech)
        audio = load_audio(body, self._max_seconds, read=read)
        chunks = speech_chunks(audio.samples, self._speech.config(body.task))
        line = TranscribedLine(
            body, audio, self._speech, self._max_tokens, self._default_sampling, [], chunks
        )
        line.language = body.request.language
        detects = getattr(self._speech.model_cls, "supports_explicit_language_detection", False)
        if line.language is None and detects:
            prompt, params = line.detection(self._llm.renderer)
            self._llm.add_request(request_id + "-language", prompt, params)
            line.request_ids.append(request_id + "-language")
            line.detecting = True
        else:
            self._add_transcriptions(line, request_id)
        return line

    def transcribe(self, line: TranscribedLine, detection: Any, request_id: str) -> list[str]:
        """A line whose language detection finished (vLLM's output ``detection``): its chunks'
        transcriptions added to the engine as ``request_id`` (``-1``, ``-2``... appended for the
        next chunks); their ids. Raises RequestError for the line's fault, TranscriptionFailed
        when the detection answered nothing."""
        line.detected(detection)
        return self._add_transcriptions(line, request_id)

    def _add_transcriptions(self, line: TranscribedLine, request_id: str) -> list[str]:
        """Every chunk rendered before any is added, so a line's fault adds none; a verbose line's
        no-speech probes (``-nospeech-N``) go in beside its chunks."""
        requests = line.transcriptions(self._llm.renderer, self._max_model_len)
        probes = line.no_speech_probes(self._llm.renderer)
        ids = [request_id if i == 0 else f"{request_id}-{i}" for i in range(len(requests))]
        probe_ids = [f"{request_id}-nospeech-{i}" for i in range(len(probes))]
        for chunk_id, (prompt, params) in zip(ids + probe_ids, requests + probes, strict=True):
            self._llm.add_request(chunk_id, prompt, params)
        line.chunk_ids.extend(ids)
        line.probe_ids.extend(probe_ids)
        line.request_ids.extend(ids + probe_ids)
        return ids + probe_ids
