"""The prompt tokens of a line's images and audio, counted for a dry run without running anything.

Why: a dry run (``workers/estimates.py``) prices a file by its prompt tokens, and validation counts
only text. An image costs what the model's multimodal processor expands it to (the demo Idefics3:
94 tokens for a square image, 57 for a 2:1 one); a transcription or translation line costs its
decoder prompt plus 100 log-mel frames a second of audio (what ``workers/transcription.py`` counts
at run time, as vLLM's usage does). Without these a file of image or audio lines was priced at its
text alone, or at nothing.

How, in bounded memory and without storing anything (a dry run makes no batch):

- An image's size is read from its header (Pillow opens it lazily; no pixel is decoded) and its
  tokens are vLLM's: the model's own multimodal processor (``MULTIMODAL_REGISTRY.create_processor``
  over a ``ModelConfig`` of the checkpoint, made once per model per process) run on a blank image of
  that size with the processor's own image placeholder text; the count is the prompt it makes less
  the same prompt without the image. Each distinct size is processed once per model per process
  (an LRU of sizes); each distinct URL is read once per file (an LRU of URL digests, as
  ``workers.images.ImageResolver`` remembers its URLs).
- Links are not fetched in a dry run (no outbound call for a price): each counts as the model's
  largest image (the size vLLM profiles with), an upper bound, and the estimate says how many.
- An image or audio named by file id is read from the tenant's own files as validation reads it
  (``workers.media_files.read_tenant_file``, given as ``file_bytes``); another tenant's, an unknown
  one or one past the byte limit is refused as the batch would refuse it.
- An image the batch would refuse (undecodable, too large, a text-only model) costs nothing: its
  line ends with an error, not a run; the estimate says how many.
- Audio: the duration is read from the file's header (libsndfile; no sample decoded), the decoder
  prompt ``[<|prev|>prompt]<|startoftranscript|><|lang|><|task|><|notimestamps|>`` tokenized by the
  model's tokenizer (a line without a language counts one language token, as the detected one is);
  frames are ``ceil(seconds * sampling_rate / hop_length)`` of the checkpoint's feature extractor.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.audio import MAX_BYTES as AUDIO_MAX_BYTES
from workers.audio import AudioError, header_seconds
from workers.audio import data_url_bytes as audio_bytes
from workers.images import ImageRefused, checkpoint_takes_images, data_url_bytes, image_parts, part_url
from workers.media_files import FileRefused
from workers.transcription import AUDIO_ENDPOINTS, TRANSLATIONS, chunks_at_most

log = logging.getLogger(__name__)

_URL_MEMORY = 65_536  # distinct image URLs of one file remembered with their tokens
_SIZE_MEMORY = 4_096  # distinct image sizes of one model remembered with their tokens
# the registry's engine arguments that change how a model's processor counts an image
_PROCESSOR_ARGS = ("trust_remote_code", "mm_processor_kwargs", "hf_overrides", "tokenizer", "tokenizer_mode")


@dataclass
class MediaTally:
    """What a file's images and audio added to its prompt tokens (the estimate's ``media``)."""

    images: int = 0  # image parts counted by their size
    image_links: int = 0  # links, not fetched: each counted as the model's largest image
    images_refused: int = 0  # parts the batch would refuse: counted as nothing
    images_not_counted: int = 0  # the model's processor could not be made here: counted as nothing
    image_tokens: int = 0
    audio_lines: int = 0
    audio_refused: int = 0  # audio the engine would refuse (undecodable, too long): nothing
    audio_seconds: float = 0.0
    audio_tokens: int = 0

    def as_dict(self) -> dict[str, Any] | None:
        """None for a file of neither."""
        if not (self.images or self.image_links or self.images_refused or self.images_not_counted
                or self.audio_lines):  # fmt: skip
            return None
        return {
            "images": self.images,
            "image_links": self.image_links,
            "images_refused": self.images_refused,
            "images_not_counted": self.images_not_counted,
            "image_tokens": self.image_tokens,
            "audio_lines": self.audio_lines,
            "audio_refused": self.audio_refused,
            "audio_seconds": round(self.audio_seconds, 3),
            "audio_tokens": self.audio_tokens,
        }


# --------------------------------------------------------------------------- images


class ImageTokens:
    """One vision model's image costs, by vLLM's own multimodal processor (thread-safe)."""

    def __init__(self, path: str, options: Mapping[str, Any]) -> None:
        from vllm.config import ModelConfig
        from vllm.multimodal import MULTIMODAL_REGISTRY

        config = ModelConfig(model=path, **{"tokenizer": path, **options})
        self._processor = MULTIMODAL_REGISTRY.create_processor(config)
        self._placeholder = self._processor.dummy_inputs.get_dummy_text({"image": 1})
        self._empty = len(self._prompt("", None))  # the prompt without the image (special tokens)
        self._sizes: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._lock = threading.Lock()
        self._largest: int | None = None

    def _prompt(self, text: str, image: Any) -> list[int]:
        processor = self._processor
        items = processor.info.parse_mm_data({"image": [image]} if image is not None else {}, validate=False)
        return list(processor(text, items)["prompt_token_ids"])

    def tokens(self, width: int, height: int) -> int:
        """The prompt tokens an image of this size adds (its placeholder expanded, markers included)."""
        key = (width, height)
        with self._lock:
            known = self._sizes.get(key)
            if known is not None:
                self._sizes.move_to_end(key)
                return known
        from PIL import Image

        counted = len(self._prompt(self._placeholder, Image.new("RGB", key))) - self._empty
        with self._lock:
            self._sizes[key] = counted
            if len(self._sizes) > _SIZE_MEMORY:
                self._sizes.popitem(last=False)
        return counted

    def largest(self) -> int:
        """The tokens of the image vLLM profiles the model with (the most one image costs)."""
        if self._largest is None:
            dummy = self._processor.dummy_inputs.get_dummy_mm_data(1 << 20, {"image": 1}, {})
            width, height = dummy["image"][0].size
            self._largest = self.tokens(width, height)
        return self._largest


@functools.lru_cache(maxsize=4)
def _image_tokens(path: str, options_json: str) -> ImageTokens:
    return ImageTokens(path, json.loads(options_json))


def image_tokens_for(path: str, engine_args: Mapping[str, Any]) -> ImageTokens:
    """One counter per checkpoint (and processor options) per process: making one costs seconds."""
    options = {k: engine_args[k] for k in _PROCESSOR_ARGS if engine_args.get(k) is not None}
    return _image_tokens(str(path), json.dumps(options, sort_keys=True))


def header_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """An image's (width, height) from its header; ImageRefused past ``max_pixels`` or unreadable."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:  # lazy: the header only
            width, height = image.size
    except Exception as exc:
        raise ImageRefused("invalid_image", f"the image cannot be read: {exc}"[:300]) from None
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ImageRefused("image_too_large", f"the image is {width}x{height} pixels")
    return width, height


# --------------------------------------------------------------------------- audio


@dataclass(frozen=True)
class SpeechTokens:
    """One speech model's audio costs: its tokenizer and its feature extractor's frame rate."""

    tokenizer: Any
    sampling_rate: int
    hop_length: int

    @classmethod
    def load(cls, path: str, tokenizer: Any) -> SpeechTokens:
        try:
            extractor = json.loads((Path(path) / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            extractor = {}
        return cls(
            tokenizer, int(extractor.get("sampling_rate") or 16_000), int(extractor.get("hop_length") or 160)
        )

    def prompt_tokens(self, endpoint: str, body: Mapping[str, Any]) -> int:
        """The decoder prompt's tokens, as ``Whisper.get_generation_prompt`` writes it."""
        task = "translate" if endpoint == TRANSLATIONS else "transcribe"
        language = body.get("language") if isinstance(body.get("language"), str) else None
        prompt = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
        text = (f"<|prev|>{prompt}" if prompt else "") + (
            f"<|startoftranscript|><|{language or 'en'}|><|{task}|><|notimestamps|>"
        )
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def audio_tokens(self, seconds: float) -> int:
        """Log-mel frames, as vLLM's ``get_num_audio_tokens`` counts them."""
        return math.ceil(seconds * self.sampling_rate / self.hop_length)


# --------------------------------------------------------------------------- one file


class MediaCounter:
    """A dry run's count of one file's media: ``count(body_json)`` is the prompt tokens a line's
    images or audio add (0 for a line of neither), summed in ``tally``.

    ``checkpoint``: model -> its checkpoint directory; ``engine_args``: model -> its registry
    engine arguments; ``tokenizer``: checkpoint -> the tokenizer validation loaded;
    ``adapters``: an adapter's name -> its base model."""

    def __init__(
        self,
        endpoint: str,
        checkpoint: Callable[[str], str],
        engine_args: Callable[[str], Mapping[str, Any]],
        tokenizer: Callable[[str], Any],
        adapters: Mapping[str, str],
        *,
        max_image_bytes: int,
        max_pixels: int,
        max_audio_seconds: float,
        file_bytes: Callable[[str, int], bytes] | None = None,
    ) -> None:
        """``file_bytes(file_id, max_bytes)``: the tenant's media file, or FileRefused (None:
        every file id is refused)."""
        self.endpoint = endpoint
        self._file_bytes = file_bytes
        self.audio = endpoint in AUDIO_ENDPOINTS
        self._checkpoint = checkpoint
        self._engine_args = engine_args
        self._tokenizer = tokenizer
        self._adapters = adapters
        self.max_image_bytes = max_image_bytes
        self.max_pixels = max_pixels
        self.max_audio_seconds = max_audio_seconds
        self.tally = MediaTally()
        # model -> its counter; None: it takes no images; False: its processor failed here
        self._images: dict[str, ImageTokens | bool | None] = {}
        self._speech: dict[str, SpeechTokens] = {}
        self._urls: OrderedDict[bytes, int] = OrderedDict()  # url digest -> tokens (-1: refused)

    def count(self, body_json: str) -> int:
        if self.audio:
            return self._audio(json.loads(body_json))
        if '"image_url"' not in body_json and '"input_image"' not in body_json:
            return 0
        body = json.loads(body_json)
        parts = list(image_parts(body))
        if not parts:
            return 0
        counter = self._image_counter(self._base(body))
        if counter is False:
            self.tally.images_not_counted += len(parts)
            return 0
        total = 0
        for _, part in parts:
            tokens = -1 if not isinstance(counter, ImageTokens) else self._image(counter, part_url(part))
            if tokens < 0:
                self.tally.images_refused += 1
            else:
                total += tokens
        self.tally.image_tokens += total
        return total

    def _base(self, body: Mapping[str, Any]) -> str:
        model = str(body.get("model"))
        return self._adapters.get(model, model)

    def _image_counter(self, model: str) -> ImageTokens | bool | None:
        if model not in self._images:
            path = self._checkpoint(model)
            counter: ImageTokens | bool | None = None
            if checkpoint_takes_images(path):
                try:
                    counter = image_tokens_for(path, self._engine_args(model))
                except Exception as exc:  # vLLM's processor for it cannot be made on this host
                    log.warning("no image token counts for model %r: %s", model, exc)
                    counter = False
            self._images[model] = counter
        return self._images[model]

    def _image(self, counter: ImageTokens, url: Any) -> int:
        """One part's tokens; -1 for a part the batch would refuse."""
        if not isinstance(url, str) or not url:
            return -1
        scheme = url.split(":", 1)[0].lower() if ":" in url[:10] else ""
        if scheme in ("http", "https"):
            self.tally.image_links += 1
            return counter.largest()
        by_file = url.startswith("file-")
        if scheme != "data" and not by_file:
            return -1
        digest = hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        known = self._urls.get(digest)
        if known is None:
            try:
                data = (
                    self._file(url, self.max_image_bytes)
                    if by_file
                    else data_url_bytes(url, self.max_image_bytes)
                )
                width, height = header_size(data, self.max_pixels)
                known = counter.tokens(width, height)
            except (ImageRefused, FileRefused):
                known = -1
            self._urls[digest] = known
            if len(self._urls) > _URL_MEMORY:
                self._urls.popitem(last=False)
        else:
            self._urls.move_to_end(digest)
        if known >= 0:
            self.tally.images += 1
        return known

    def _audio(self, body: Mapping[str, Any]) -> int:
        self.tally.audio_lines += 1
        url = str(body.get("file_url") or "")
        try:
            data = self._file(url, AUDIO_MAX_BYTES) if url.startswith("file-") else audio_bytes(url)
            seconds = header_seconds(data, self.max_audio_seconds)
        except (AudioError, FileRefused):
            self.tally.audio_refused += 1
            return 0
        speech = self._speech_of(self._base(body))
        # a decoder prompt per 30 s chunk (an upper bound past 30 s: the engine cuts at pauses)
        prompts = speech.prompt_tokens(self.endpoint, body) * chunks_at_most(seconds)
        tokens = prompts + speech.audio_tokens(seconds)
        self.tally.audio_seconds += seconds
        self.tally.audio_tokens += tokens
        return tokens

    def _file(self, file_id: str, max_bytes: int) -> bytes:
        if self._file_bytes is None:
            raise FileRefused("file_not_found", "file ids are not read here", 404)
        return self._file_bytes(file_id, max_bytes)

    def _speech_of(self, model: str) -> SpeechTokens:
        if model not in self._speech:
            path = self._checkpoint(model)
            self._speech[model] = SpeechTokens.load(path, self._tokenizer(path))
        return self._speech[model]
