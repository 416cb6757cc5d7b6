"""Media given by file id: an image part or an audio line naming a file its tenant uploaded
through ``/v1/files`` (purpose ``vision`` or ``user_data``, as OpenAI takes image inputs by id),
read at validation by the control worker and stored beside the batch's shards like a data URL's.

Why at validation and not on the engine worker: the file is the tenant's and may be deleted or
expire after the batch is created, so validation copies what the line names into the batch's own
objects (``batches/<id>/images/<sha256>``, ``batches/<id>/audio/<sha256>``: once per distinct
content however many lines name it) and the line runs with exactly the bytes that were checked; the
engine worker reads only the batch's objects, never a tenant's files.

A file id is looked up as its tenant's: another tenant's id, an unknown, deleted or expired one
answer alike, ``file_not_found`` with status 404 as that line's error, so no tenant learns another's
ids exist. A file of another purpose (a batch input, a batch's output) is ``invalid_file_purpose``.
The size is refused from the file's row before a byte is read (the image or audio byte limit), and
at most that many bytes are read in any case.

An audio line's ``file_url`` holding a file id is rewritten to ``freight-audio:<sha256>`` (read by
``AudioCache`` on the engine worker, read ahead with each pack); a refused one makes the stored body the line's refusal
(``request_errors.REFUSED_LINE``, with its model), raised when the line runs, while the file's other
lines go on.

An audio line's data URL (a JSONL line's ``file_url``, or a Parquet input's ``audio`` cell, which
``storage.request_tables`` makes a data URL) is stored the same way, once per distinct content, for
a batch of an audio endpoint (``data_urls``): a file of two thousand lines over forty recordings
keeps forty objects, not two thousand base64 copies in its request store, and its engine worker
reads and decodes each line's audio from the batch's object (``AudioCache``), not from its row.
Each distinct clip's header is read before it is stored (``audio.header_seconds``): bytes no
decoder reads and audio past FREIGHT_MAX_AUDIO_SECONDS are that line's refusal at validation, as
an unreadable file id is, so the dry run prices them as refused and no engine sees them.

Every object of a batch's media, image or audio, is written by ``store_once``: once per distinct
content per batch, however many lines, files or validation chunks carry it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import IO

from storage.models import StoredFile
from storage.objectstore import CHUNK, ObjectNotFound, ObjectStore
from storage.retention import MEDIA_PURPOSES, live
from storage.runtime import Runtime
from workers.audio import MAX_BYTES as AUDIO_MAX_BYTES
from workers.audio import MAX_SECONDS as AUDIO_MAX_SECONDS
from workers.audio import AudioError, data_url_bytes, header_seconds
from workers.request_errors import REFUSED_LINE, RequestError

log = logging.getLogger(__name__)

FILE_ID = re.compile(r"file-[A-Za-z0-9_-]{1,64}")  # what new_id("file-") makes, and OpenAI's ids
AUDIO_REF = "freight-audio:"  # + the sha256 hex of the stored bytes
_HEX = frozenset("0123456789abcdef")
STORED_MEMORY = 65_536  # distinct digests one resolver remembers having stored (64-char strings)
_CHECKED_MEMORY = 65_536  # distinct audio contents whose header outcome one resolver remembers


def is_file_id(value: object) -> bool:
    return isinstance(value, str) and FILE_ID.fullmatch(value) is not None


class FileRefused(Exception):
    """A file id a line cannot use: ``code`` and ``status`` are the line's error."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def read_tenant_file(rt: Runtime, tenant_id: str, file_id: str, max_bytes: int, too_large: str) -> bytes:
    """The bytes of ``tenant_id``'s live media file ``file_id``, at most ``max_bytes`` (else
    ``too_large``, the code of the kind: image_too_large, audio_too_large); raises FileRefused."""
    missing = FileRefused("file_not_found", f"No such File object: {file_id[:80]}", 404)
    if not is_file_id(file_id):
        raise missing
    with rt.db.read() as s:
        record = s.get(StoredFile, file_id)
        if record is None or record.tenant_id != tenant_id or not live(record, time.time()):
            raise missing
        purpose, size, key = record.purpose, record.bytes, record.object_key
    if purpose not in MEDIA_PURPOSES:
        raise FileRefused(
            "invalid_file_purpose",
            f"file {file_id} has purpose {purpose!r}; media are uploaded with purpose"
            f" {' or '.join(MEDIA_PURPOSES)}",
        )
    if size > max_bytes:
        raise FileRefused(too_large, f"file {file_id} is {size} bytes; the limit is {max_bytes}")
    try:
        with rt.store.open(key) as stream:
            data = _read_at_most(stream, max_bytes + 1)
    except ObjectNotFound:  # deleted since the row was read
        raise missing from None
    if len(data) > max_bytes:
        raise FileRefused(too_large, f"file {file_id} is over {max_bytes} bytes; the limit is {max_bytes}")
    return data


def _read_at_most(stream: IO[bytes], limit: int) -> bytes:
    """Up to ``limit`` bytes of ``stream`` (a store's stream may answer a read with fewer)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = stream.read(min(CHUNK, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def store_once(
    store: ObjectStore,
    data: bytes,
    key_of: Callable[[str], str],
    stored: set[str],
    check: Callable[[bytes], object] | None = None,
    digest: str | None = None,
) -> str:
    """Store a batch's media object under the sha256 of its bytes (``key_of(digest)``: the batch's
    images/ or audio/ key), unless this batch already holds it; the digest.

    Invariant: the key exists only once a resolver of that batch ran ``check`` on those very bytes
    and it passed (the write, after it, is one atomic put), so an object found there passed the same
    checks and is neither checked nor written again. ``stored`` holds the digests this resolver
    stored or found stored (at most STORED_MEMORY; past it the store is asked), so a file of two
    thousand lines over forty clips asks the store forty times; the store's own answer covers what
    another resolver of the batch wrote: each chunk of a chunked validation
    (``workers.validation_chunks``) has a resolver of its own and sees most of the batch's media
    (the images bench's 2,000 lines over 50 images in 7 chunks decoded and wrote 350 images for 50
    before). Two chunks racing on one object both check and write the same bytes. ``check`` raises
    to refuse the bytes; nothing is stored then. ``digest``: the bytes' sha256 (hex) where the
    caller has it already."""
    digest = digest or hashlib.sha256(data).hexdigest()
    if digest in stored:
        return digest
    key = key_of(digest)
    if not store.exists(key):
        if check is not None:
            check(data)
        store.put_chunks(key, [data])
    if len(stored) < STORED_MEMORY:
        stored.add(digest)
    return digest


# --------------------------------------------------------------------------- audio


def audio_key(batch_id: str, digest: str) -> str:
    return f"batches/{batch_id}/audio/{digest}"


def is_audio_ref(url: object) -> bool:
    """A reference validation wrote (a tenant's own is refused: only file ids are resolved)."""
    return (
        isinstance(url, str)
        and url.startswith(AUDIO_REF)
        and len(url) == len(AUDIO_REF) + 64
        and set(url[len(AUDIO_REF) :]) <= _HEX
    )


class AudioFiles:
    """Validation's side for one batch: an audio line's ``file_url`` file id resolved, each
    distinct file read once per file of lines and each distinct content stored once; with
    ``data_urls`` (a batch of an audio endpoint) its data URLs too."""

    def __init__(
        self,
        rt: Runtime,
        batch_id: str,
        tenant_id: str,
        max_bytes: int = AUDIO_MAX_BYTES,
        data_urls: bool = False,
        max_seconds: float = AUDIO_MAX_SECONDS,
    ) -> None:
        self.rt = rt
        self.batch_id = batch_id
        self.tenant_id = tenant_id
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds  # FREIGHT_MAX_AUDIO_SECONDS
        self._outcomes: dict[str, str | FileRefused] = {}  # file id -> its ref or its refusal
        # content digest -> its ref or its refusal: each distinct clip's header read once
        self._checked: OrderedDict[str, str | FileRefused] = OrderedDict()
        self.refused = 0
        # an audio endpoint's batch: a line's data URL is stored too (JSONL or Parquet); in another
        # endpoint's line a ``file_url`` is no audio, and is left to that line's shape checks
        self.data_urls = data_urls
        self._stored: set[str] = set()  # digests this resolver stored or found stored (store_once)

    def resolve(self, body: dict) -> bool:
        """Rewrite ``body`` in place if its ``file_url`` is a file id (or, with ``data_urls``,
        a data URL); True if it was."""
        file_id = body.get("file_url")
        if not isinstance(file_id, str):
            return False
        if self.data_urls and file_id.startswith("data:"):
            outcome = self._data_outcome(file_id)
        elif file_id.startswith("file-"):
            outcome = self._outcome(file_id)
        else:
            return False
        if isinstance(outcome, FileRefused):
            self.refused += 1
            # the stored body is the line's error (raised by parse_body when it runs), first as
            # validation's RefusedLine rows hold theirs; its model stays for the row's checks
            model = body.get("model")
            body.clear()
            body[REFUSED_LINE] = {
                "code": outcome.code,
                "message": f"`file_url`: {outcome.message}",
                "param": "file_url",
                "status": outcome.status,
            }
            body["model"] = model
        else:
            body["file_url"] = outcome
        return True

    def _data_outcome(self, url: str) -> str | FileRefused:
        """A data URL's bytes stored under their digest (decoded within the byte limit; refused
        as the line's ``invalid_audio`` or ``audio_too_large``, as the engine refuses a data URL it
        is given). Not remembered by URL: a line's URL is as long as its audio."""
        try:
            data = data_url_bytes(url, self.max_bytes)
        except AudioError as exc:
            return FileRefused(exc.code, exc.message)
        return self._store(data)

    def _store(self, data: bytes) -> str | FileRefused:
        """The clip's reference, stored once per content, if its header says audio within the
        duration limit; else the line's refusal (``invalid_audio``, ``audio_too_long``), stored
        nowhere: bytes that are no audio cost the batch neither a stored object nor engine time.
        Each distinct content's header is read once (a bounded memory of digests), and not at all
        when another resolver of the batch stored it (``store_once``'s invariant)."""
        digest = hashlib.sha256(data).hexdigest()
        known = self._checked.get(digest)
        if known is None:
            try:
                known = AUDIO_REF + store_once(
                    self.rt.store,
                    data,
                    lambda digest: audio_key(self.batch_id, digest),
                    self._stored,
                    check=lambda clip: header_seconds(clip, self.max_seconds),  # raises AudioError
                    digest=digest,
                )
            except AudioError as exc:
                known = FileRefused(exc.code, exc.message)
            self._checked[digest] = known
            if len(self._checked) > _CHECKED_MEMORY:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(digest)
        return known

    def _outcome(self, file_id: str) -> str | FileRefused:
        if not is_file_id(file_id):  # not remembered: such a string may be as long as its line
            return FileRefused("file_not_found", f"No such File object: {file_id[:80]}", 404)
        known = self._outcomes.get(file_id)
        if known is not None:
            return known
        try:
            data = read_tenant_file(self.rt, self.tenant_id, file_id, self.max_bytes, "audio_too_large")
            outcome: str | FileRefused = self._store(data)
        except FileRefused as exc:
            outcome = exc
        if len(self._outcomes) < 65_536:  # distinct ids of one file remembered
            self._outcomes[file_id] = outcome
        return outcome


class AudioCache:
    """An engine worker's stored audio of the lines it has claimed, read ahead with each pack by
    the feed's thread (``prefetch``), so the engine loop, which makes no store call, finds a line's
    bytes in memory when it submits the line (``reader``). Kept encoded (a WAV of 30 s at 16 kHz is
    about 1 MB; decoded to float32 it would be twice that) and decoded by the line's submit as a data
    URL's audio is. Bounded by ``max_bytes``: the least recently used dropped past it; a reference
    dropped before its line ran (a pack holding more audio than the bound) is read again on the
    loop's thread, counted in ``late_reads``."""

    def __init__(self, rt: Runtime, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.rt = rt
        self.max_bytes = max_bytes
        self._audio: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.loads = 0  # reads from the store
        self.late_reads = 0  # of those, the ones made when a line was submitted

    def prefetch(self, batch_id: str, bodies: Iterable[str]) -> None:
        """Read the audio these stored bodies (a pack's rows) name that is not held yet."""
        for body_json in bodies:
            if AUDIO_REF not in body_json:
                continue
            try:
                url = json.loads(body_json).get("file_url")
            except (ValueError, AttributeError):  # not an audio body: its line's own error later
                continue
            if is_audio_ref(url):
                self._get(batch_id, url, late=False)

    def reader(self, batch_id: str) -> Callable[[str], bytes]:
        """What an EngineRequest of ``batch_id`` carries: its audio reference -> the stored bytes."""
        return lambda ref: self._get(batch_id, ref, late=True)

    def _get(self, batch_id: str, ref: str, late: bool) -> bytes:
        key = (batch_id, ref)
        with self._lock:
            held = self._audio.get(key)
            if held is not None:
                self._audio.move_to_end(key)
                return held
        data = read_audio_ref(self.rt, batch_id, ref)
        with self._lock:
            self.loads += 1
            self.late_reads += late
            if key not in self._audio:
                self._audio[key] = data
                self._bytes += len(data)
                while self._bytes > self.max_bytes and len(self._audio) > 1:
                    _, dropped = self._audio.popitem(last=False)
                    self._bytes -= len(dropped)
        if late:
            log.info("audio %s of batch %s read on submit: not held ahead", ref[-12:], batch_id)
        return data


def read_audio_ref(rt: Runtime, batch_id: str, ref: str) -> bytes:
    """The engine worker's read of an audio line's stored bytes, checked against their digest."""
    digest = ref[len(AUDIO_REF) :]
    with rt.store.open(audio_key(batch_id, digest)) as stream:
        data = stream.read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise RequestError("internal_error", "stored audio does not match its digest", status_code=500)
    return data
