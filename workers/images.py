"""Images in chat lines: checked and stored once at validation, handed to vLLM decoded at run time.

A chat line's content part ``{"type": "image_url", "image_url": {"url": ...}}`` holds a ``data:``
URL (base64 PNG, JPEG, WebP or GIF), an ``http(s)://`` link or the id of a file the tenant uploaded
(``file-...``, or a Responses ``input_image``'s ``file_id``: read by ``workers.media_files``, which
also resolves an audio line's file id for ``ImageResolver``, the batch's one media resolver).
Validation (``ImageResolver``) decodes or fetches each, checks it (bytes, pixels read from the header before decoding, a format
Pillow decodes whole, a model that takes images) and rewrites the part in the stored body:

- ``freight-image:<sha256 of the bytes>``: the image is stored once per distinct content beside the
  batch's shards (``batches/<id>/images/<sha256>``), however many lines carry it, and the line's
  prompt key names it, so lines with one image and one prefix are ordered together and meet in
  vLLM's prefix cache (whose key for an image is its content hash, here the ``uuid`` vLLM is given).
- ``freight-refused:``, with the reason beside it: that line alone ends with an error line naming
  the part (``messages.0.content.1``) when it comes to run; the file and its other lines go on.

Why rewrite instead of keeping the URL: the request store stays small (an image of 50 lines is
stored once, not fifty times in base64), links are fetched once and never by an engine worker (no
outbound traffic from the accelerator hosts, and the image a line runs with is the one checked),
and an engine worker decodes each distinct image once (``ImageCache``), not once a line.

A link is a tenant's input: fetched under the webhooks' address checks (``workers.outbound_http``;
FREIGHT_IMAGE_FETCH_ALLOW_PRIVATE_TARGETS), cut off at FREIGHT_IMAGE_FETCH_TIMEOUT_SECONDS, at most
FREIGHT_IMAGE_MAX_BYTES read, FREIGHT_IMAGE_TENANT_FETCHES of a tenant's in flight across every
control process, and none at all when FREIGHT_IMAGE_FETCH is off.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from storage.checkpoint_config import config_or_empty
from storage.runtime import Runtime
from workers.media_files import AudioFiles, FileRefused, is_file_id, read_tenant_file, store_once
from workers.outbound_http import Call, OutboundError, get_following
from workers.request_errors import RequestError

log = logging.getLogger(__name__)

IMAGE_REF = "freight-image:"  # + the sha256 hex of the stored bytes
FILE_ID_REFUSED = "\x00file_id"  # an input_image's file_id that is no file id: file_not_found
REFUSED_REF = "freight-refused:"  # the part's "refused" holds the error of the line
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
USER_AGENT = "Freight-Images/1"
REDIRECTS = 3
_HEX = frozenset("0123456789abcdef")
_URL_MEMORY = 65_536  # distinct URLs of one file remembered with their outcome


def image_key(batch_id: str, digest: str) -> str:
    return f"batches/{batch_id}/images/{digest}"


def is_image_ref(url: object) -> bool:
    """A reference validation wrote (never a tenant's: ``ImageResolver`` refuses those)."""
    return (
        isinstance(url, str)
        and url.startswith(IMAGE_REF)
        and len(url) == len(IMAGE_REF) + 64
        and set(url[len(IMAGE_REF) :]) <= _HEX
    )


def image_parts(body: Any) -> Iterator[tuple[str, dict]]:
    """Each image part of a body, with the param naming it: chat's ``image_url`` parts of its
    ``messages``, and a Responses body's ``input_image`` parts of its ``input`` items."""
    if not isinstance(body, dict):
        return
    for field, kind in (("messages", "image_url"), ("input", "input_image")):
        items = body.get(field)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, dict) and part.get("type") == kind:
                        yield f"{field}.{i}.content.{j}", part


def part_url(part: dict) -> Any:
    """An image part's URL: chat's ``image_url.url``, or Responses' ``image_url`` string (or its
    ``file_id`` when it has no ``image_url``: a file id is resolved like chat's ``file-...`` URL)."""
    image_url = part.get("image_url")
    if part.get("type") == "input_image":
        if image_url is None and part.get("file_id") is not None:
            file_id = part["file_id"]
            return file_id if is_file_id(file_id) else FILE_ID_REFUSED
        return image_url
    return image_url.get("url") if isinstance(image_url, dict) else None


def refusal(part: dict) -> RequestError:
    """The error validation recorded in a refused part (the line's error at run time)."""
    given = part.get("refused")
    refused: dict = given if isinstance(given, dict) else {}
    status = refused.get("status")
    return RequestError(
        str(refused.get("code") or "invalid_image"),
        str(refused.get("message") or "The image was refused at validation."),
        str(refused.get("param")) if refused.get("param") else None,
        status if isinstance(status, int) and 400 <= status < 500 else 400,
    )


# --------------------------------------------------------------------------- checks


class ImageRefused(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 ``data:image/...`` URL, refused past ``max_bytes`` before decoding."""
    head, comma, payload = url.partition(",")
    if not comma or not head.lower().endswith(";base64") or not head[5:].lower().startswith("image/"):
        raise ImageRefused("invalid_image", "a data URL must be data:image/<format>;base64,<data>")
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise ImageRefused(
            "image_too_large", f"the image is about {len(payload) * 3 // 4} bytes; the limit is {max_bytes}"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("invalid_image", "the data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageRefused("image_too_large", f"the image is {len(data)} bytes; the limit is {max_bytes}")
    return data


def check_image(data: bytes, max_pixels: int) -> tuple[str, int, int]:
    """(MIME type, width, height) of an image Pillow decodes whole; its size is read from the header
    and refused past ``max_pixels`` before any pixel is decoded. Raises ImageRefused."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
            width, height = image.size
            if kind not in FORMATS:
                raise ImageRefused(
                    "invalid_image", f"{kind or 'unknown'} images are not supported (PNG, JPEG, WebP or GIF)"
                )
            if width * height > max_pixels:
                raise ImageRefused(
                    "image_too_large",
                    f"the image is {width}x{height} pixels; the limit is {max_pixels} (FREIGHT_IMAGE_MAX_PIXELS)",
                )
            if width < 1 or height < 1:
                raise ImageRefused("invalid_image", "the image has no pixels")
            image.load()  # decodes every pixel: truncated or corrupt data fails here
    except ImageRefused:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own limit, past ours unless raised
        raise ImageRefused("image_too_large", str(exc)[:300]) from None
    except Exception as exc:  # Pillow raises many kinds (OSError, SyntaxError, ValueError, ...)
        raise ImageRefused("invalid_image", f"the image cannot be decoded: {exc}"[:300]) from None
    return FORMATS[kind], width, height


def takes_images(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config.json describes a model with a vision encoder."""
    keys = ("vision_config", "vision_tower", "image_token_id", "image_token_index", "mm_vision_tower")
    return any(config.get(k) is not None for k in keys)


def checkpoint_takes_images(path: str) -> bool:
    return takes_images(config_or_empty(path))


# --------------------------------------------------------------------------- validation side


class ImageResolver:
    """Validation's side for one batch (see the module docstring): ``resolve`` rewrites the image
    parts of one body in place, and an audio line's file id (``media_files.AudioFiles``; its data
    URL too when ``audio_lines``: a batch of an audio endpoint). Each distinct URL or file id is
    decoded, fetched or read once per file (a bounded memory of URL digests), each distinct image
    checked and stored once per batch (``media_files.store_once``)."""

    def __init__(
        self,
        rt: Runtime,
        batch_id: str,
        tenant_id: str,
        model_takes_images: Callable[[str], bool],
        audio_lines: bool = False,
    ) -> None:
        self.rt = rt
        self.batch_id = batch_id
        self.tenant_id = tenant_id
        self.model_takes_images = model_takes_images
        self._outcomes: OrderedDict[bytes, tuple[str, str, int]] = (
            OrderedDict()
        )  # url digest -> (ref or code, message, status)
        self._stored: set[str] = set()  # digests this resolver stored or found stored (store_once)
        self.fetches = 0
        self.refused = 0
        self.audio = AudioFiles(
            rt, batch_id, tenant_id, data_urls=audio_lines, max_seconds=rt.settings.max_audio_seconds
        )

    def resolve(self, model: str, body: dict) -> bool:
        """Rewrite every image part of ``body`` (or an audio line's file id); True if it held any."""
        if self.audio.resolve(body):
            return True
        parts = list(image_parts(body))
        if not parts:
            return False
        vision = self.model_takes_images(model)
        for param, part in parts:
            if not vision:
                outcome = ("image_input_not_supported", f"model {model[:200]!r} does not take images", 400)
            else:
                outcome = self._outcome(part_url(part))
            code, message, status = outcome
            kind = part.get("type")
            part.clear()
            part["type"] = kind
            url = code if code.startswith(IMAGE_REF) else REFUSED_REF
            part["image_url"] = url if kind == "input_image" else {"url": url}
            if url == REFUSED_REF:
                self.refused += 1
                part["refused"] = {"code": code, "message": f"`{param}`: {message}", "param": param}
                if status != 400:
                    part["refused"]["status"] = status
        return True

    def _outcome(self, url: Any) -> tuple[str, str, int]:
        if url == FILE_ID_REFUSED:
            return "file_not_found", "file_id is not the id of a file", 404
        if not isinstance(url, str) or not url:
            return "invalid_image", "image_url.url must be a non-empty string", 400
        digest = hashlib.blake2b(url.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        known = self._outcomes.get(digest)
        if known is not None:
            self._outcomes.move_to_end(digest)
            return known
        try:
            data = self._bytes(url)
            max_pixels = self.rt.settings.image_max_pixels
            sha = store_once(
                self.rt.store,
                data,
                lambda digest: image_key(self.batch_id, digest),
                self._stored,
                check=lambda image: check_image(image, max_pixels),  # raises ImageRefused
            )
            outcome = (IMAGE_REF + sha, "", 200)
        except ImageRefused as exc:
            outcome = (exc.code, exc.message, exc.status)
        self._outcomes[digest] = outcome
        if len(self._outcomes) > _URL_MEMORY:
            self._outcomes.popitem(last=False)
        return outcome

    def _bytes(self, url: str) -> bytes:
        settings = self.rt.settings
        scheme = url.split(":", 1)[0].lower() if ":" in url[:10] else ""
        if scheme == "data":
            return data_url_bytes(url, settings.image_max_bytes)
        if url.startswith("file-"):  # a file the tenant uploaded (workers/media_files.py)
            try:
                return read_tenant_file(
                    self.rt, self.tenant_id, url, settings.image_max_bytes, "image_too_large"
                )
            except FileRefused as exc:
                raise ImageRefused(exc.code, exc.message, exc.status) from None
        if scheme not in ("http", "https"):
            raise ImageRefused(
                "invalid_image_url", "an image URL must be a data: URL, an http(s):// link or a file id"
            )
        if not settings.image_fetch:
            raise ImageRefused(
                "image_fetch_disabled",
                "image links are not fetched here (FREIGHT_IMAGE_FETCH is off): send a data: URL",
            )
        if len(url) > 8192:
            raise ImageRefused("invalid_image_url", "an image link must be at most 8192 characters")
        return self._fetch(url)

    def _fetch(self, url: str) -> bytes:
        settings = self.rt.settings
        slots = self.rt.queue.image_fetches
        token = uuid.uuid4().hex
        lifetime = settings.image_fetch_timeout_seconds + 30
        deadline = time.monotonic() + max(60.0, 6 * settings.image_fetch_timeout_seconds)
        while not slots.take(self.tenant_id, token, time.time(), lifetime, settings.image_tenant_fetches):
            if time.monotonic() > deadline:  # the tenant's other fetches hold every slot this long
                raise ImageRefused("image_fetch_failed", "the tenant's other image fetches held every slot")
            time.sleep(0.05)
        self.fetches += 1
        call = Call(
            settings.image_fetch_timeout_seconds,
            settings.image_max_bytes,
            settings.image_fetch_allow_private_targets,
            "FREIGHT_IMAGE_FETCH_ALLOW_PRIVATE_TARGETS",
            USER_AGENT,
            tenant=self.tenant_id,  # its host lookups counted against it (outbound_http.TenantLookups)
            tenant_lookups=settings.image_tenant_fetches,
        )
        try:
            answer = get_following(url, call, REDIRECTS)
        except TimeoutError as exc:
            raise ImageRefused(
                "image_fetch_failed",
                f"fetching the image failed: {exc} (FREIGHT_IMAGE_FETCH_TIMEOUT_SECONDS)",
            ) from None
        except OutboundError as exc:
            code = (
                "image_too_large"
                if "limit is" in str(exc) or "the limit" in str(exc)
                else "image_fetch_failed"
            )
            raise ImageRefused(code, f"fetching the image failed: {exc}"[:300]) from None
        finally:
            slots.give_back(self.tenant_id, token)
        if answer.status != 200:
            raise ImageRefused("image_fetch_failed", f"fetching the image failed: HTTP {answer.status}")
        return answer.body


def images_in(body_json: str) -> bool:
    """Cheap test of a stored body for image references (most lines hold none)."""
    return IMAGE_REF in body_json


# --------------------------------------------------------------------------- engine side


class ImageCache:
    """An engine worker's decoded images, least recently used dropped past ``max_bytes`` of pixels;
    read from the object store on a miss (``prefetch`` reads a pack's ahead, off the engine loop)."""

    def __init__(self, rt: Runtime, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.rt = rt
        self.max_bytes = max_bytes
        self._images: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.loads = 0

    def get(self, batch_id: str, digest: str) -> Any:
        key = (batch_id, digest)
        with self._lock:
            hit = self._images.get(key)
            if hit is not None:
                self._images.move_to_end(key)
                return hit[0]
        image = self._load(batch_id, digest)
        size = image.width * image.height * len(image.getbands())
        with self._lock:
            if key not in self._images:
                self._images[key] = (image, size)
                self._bytes += size
                while self._bytes > self.max_bytes and len(self._images) > 1:
                    _, (_, dropped) = self._images.popitem(last=False)
                    self._bytes -= dropped
        return image

    def _load(self, batch_id: str, digest: str) -> Any:
        from PIL import Image

        with self.rt.store.open(image_key(batch_id, digest)) as stream:
            data = stream.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise RequestError("internal_error", "a stored image does not match its digest", status_code=500)
        self.loads += 1
        image = Image.open(io.BytesIO(data))
        image.load()
        return image

    def prefetch(self, batch_id: str, bodies: Iterator[str]) -> None:
        """Load the images of these stored bodies (a pack's rows) that are not loaded yet."""
        for body_json in bodies:
            if not images_in(body_json):
                continue
            for _, part in image_parts(json.loads(body_json)):
                url = part_url(part)
                if is_image_ref(url):
                    self.get(batch_id, url[len(IMAGE_REF) :])

    def lookup(self, batch_id: str) -> Callable[[str], Any]:
        """What an EngineRequest of ``batch_id`` carries: digest -> decoded image."""
        return lambda digest: self.get(batch_id, digest)


def inline_images(messages: Any, lookup: Callable[[str], Any]) -> None:
    """A parsed chat request's image references replaced by the decoded images, with their digest
    as vLLM's multimodal ``uuid`` (its processor and prefix caches key on it: the content hash,
    so equal images meet and different ones never do)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part_url(part)
                if not is_image_ref(url):
                    raise RequestError(
                        "invalid_request", "an image reference the engine cannot read", "messages"
                    )
                digest = url[len(IMAGE_REF) :]
                content[j] = {"type": "image_pil", "image_pil": lookup(digest), "uuid": digest}
