"""``Idempotency-Key`` on creates: a create retried with the key it was first sent with answers
what it answered then, and makes nothing more (Stripe's and OpenAI's convention).

``@idempotent`` goes under ``@require_tenant`` on a create route; that one line is all a route
needs. With the header, the request:

- with a key never used (or used more than 24 hours ago), runs, and its answer is kept with a
  digest of the request (method, path, body);
- with a key whose request is still running, is refused (409 ``idempotency_key_in_use``): it is
  not run a second time beside it;
- with a key whose request ran, answers that request's answer again (same status, same body:
  same ids, and ``Idempotent-Replayed: true``) if its digest is the same, else is refused (409
  ``idempotency_key_reused``, naming the key). Nothing runs either way.

A JSON body's digest is its canonical JSON's (keys sorted, no spaces), so a retry serialized by
another client is the same request.

A request that fails (any error answer) keeps nothing and frees its key: the creates make nothing
when they refuse, so running the request again is what a retry should do.

A process that dies after its create committed and before its answer was recorded: the create's
own transaction noted the object it made on the key (``storage.idempotency.note_created``), so a
retry answers that object as it is now (``REPLAYS``), with ``Idempotent-Replayed: true``, instead
of making another. Its digest is compared over the body bytes the first request had read when it
committed (all of a JSON body; a file's upload up to the end of its file part, about).

The body's digest: a small body (JSON) is read once, bounded by ``FREIGHT_MAX_JSON_BODY_BYTES``,
and hashed; a larger one (a file's upload, an upload's part) is hashed as the view streams it to
the store, never held whole, and a retry's is hashed as it is read and dropped. A multipart
body's boundary is left out of its digest: a client draws a new one for every attempt.
"""

from __future__ import annotations

import hashlib
import time
import unicodedata
from collections.abc import Callable
from functools import wraps
from typing import IO, Any, cast

from flask import Response, current_app, g, request
from werkzeug.http import parse_options_header

from api.serializers import batch_object, estimate_object, file_object, upload_object, upload_part_object
from api.services import batches, estimates, files, uploads
from scheduler import json_text
from storage import idempotency
from storage.errors import ServiceError
from storage.runtime import Runtime

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
READ_CHUNK = 64 * 1024

# each kind of object a create notes on its key (its OpenAI ``object``), as a create answers it:
# the first answer of a create whose process died before recording it
REPLAYS: dict[str, Callable[[Runtime, str, str], dict[str, Any]]] = {
    "file": lambda rt, tenant, id_: file_object(files.get(rt, tenant, id_)),
    "batch": lambda rt, tenant, id_: batch_object(*batches.get_with_progress(rt, tenant, id_)),
    "batch.estimate": lambda rt, tenant, id_: estimate_object(estimates.get(rt, tenant, id_)),
    "upload": lambda rt, tenant, id_: upload_object(*uploads.get(rt, tenant, id_)),
    "upload.part": lambda rt, tenant, id_: upload_part_object(uploads.get_part(rt, tenant, id_)),
}


def idempotent(view: Callable[..., Any]) -> Callable[..., Any]:
    """Make a create route answer retries with ``Idempotency-Key`` by its first answer (see the
    module's doc). Goes under ``@require_tenant``: keys are the tenant's own."""

    @wraps(view)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        key = request_key()
        if key is None:
            return view(*args, **kwargs)
        body = BodyDigest()  # before the claim: reading a small body may refuse it (413)
        rt = current_app.extensions["freight"]
        db = rt.db
        tenant_id = g.tenant_id
        claimed = idempotency.claim(db, tenant_id, key, time.time())
        if isinstance(claimed, idempotency.Answer):
            return replay(key, claimed, body.rest())
        if isinstance(claimed, idempotency.Created):
            return replay_created(rt, tenant_id, key, claimed, body)
        if not isinstance(claimed, idempotency.Claim):  # in flight
            raise ServiceError(
                "conflict",
                f"A request with {HEADER} {key!r} is still being processed; retry once it has answered.",
                param=HEADER,
                code="idempotency_key_in_use",
                retry_after=1,  # the official client waits this long, then retries the 409
            )
        try:
            with idempotency.creating(tenant_id, key, claimed, body.so_far):
                response = current_app.make_response(view(*args, **kwargs))
            digest = body.rest()
        except BaseException:
            idempotency.release(db, tenant_id, key, claimed)
            raise
        if response.status_code >= 400 or response.is_streamed:
            idempotency.release(db, tenant_id, key, claimed)
            return response
        idempotency.complete(
            db, tenant_id, key, claimed, digest, response.status_code, response.get_data(as_text=True)
        )
        return response

    return wrapped


def request_key() -> str | None:
    """The request's ``Idempotency-Key``, checked; None without one."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not key or len(key) > MAX_KEY_CHARS:
        raise ServiceError(
            "invalid_request",
            f"{HEADER} must be 1 to {MAX_KEY_CHARS} characters long (this one is {len(key)})",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    if any(unicodedata.category(c) == "Cc" for c in key):
        raise ServiceError(
            "invalid_request",
            f"{HEADER} must not contain control characters",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    return key


def replay(key: str, first: idempotency.Answer, digest: str | None) -> Response:
    """The first answer again, if this is the same request; else the key's misuse, refused."""
    if digest != first.request_digest:
        raise ServiceError(
            "conflict",
            f"{HEADER} {key!r} was already used with a different request (another method, path or "
            "body) in the last 24 hours; use a new key for a new request.",
            param=HEADER,
            code="idempotency_key_reused",
        )
    response = Response(first.body, status=first.status, mimetype="application/json")
    response.headers["Idempotent-Replayed"] = "true"
    return response


def replay_created(
    rt: Runtime, tenant_id: str, key: str, made: idempotency.Created, body: BodyDigest
) -> Response:
    """The object the key's first request made, as it is now, if this is the same request (over
    the body bytes the first had read when it committed); else the key's misuse, refused."""
    first = idempotency.Answer(made.request_digest, 200, "")
    replay(key, first, body.prefix(made.digest_bytes))  # the digest, compared; refuses a mismatch
    response = Response(
        json_text.dumps(REPLAYS[made.kind](rt, tenant_id, made.object_id)), mimetype="application/json"
    )
    response.headers["Idempotent-Replayed"] = "true"
    return response


class BodyDigest:
    """The digest of this request: its method, path and body. A small body (one held to
    ``FREIGHT_MAX_JSON_BODY_BYTES`` by ``api.app``'s screen) is read here and stays cached for
    the view; a larger one (a file, an upload's part) is hashed as the view reads it:
    ``request.stream`` is replaced by a hashing reader."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256(f"{request.method} {request.path}\n".encode())
        self._reader: _HashingReader | None = None
        limit = request.max_content_length
        if limit is not None and limit <= current_app.extensions["freight"].settings.max_json_body_bytes:
            self._sha.update(_canonical(request.get_data(cache=True)))
        else:
            self._reader = _HashingReader(request.stream, self._sha, _boundary())
            request.stream = cast(IO[bytes], self._reader)  # the view reads the body through it

    def rest(self) -> str:
        """Read (and hash) what the view left unread of the body; the request's digest."""
        if self._reader is not None:
            while self._reader.read(READ_CHUNK):
                pass
        return self._sha.hexdigest()

    def so_far(self) -> tuple[str, int | None]:
        """The digest over the body read so far, and how many of its bytes that is (None: a
        small body, read whole at the start)."""
        if self._reader is None:
            return self._sha.hexdigest(), None
        return self._reader.so_far()

    def prefix(self, size: int | None) -> str | None:
        """The digest over the first ``size`` bytes of the body as ``so_far`` counts them (None:
        all of it), reading it all; None if the body is shorter."""
        if size is None:
            return self.rest() if self._reader is None else None
        if self._reader is None:
            return None  # a small body's digest is always of all of it
        self._reader.mark(size)
        self.rest()
        return self._reader.at_mark


def _canonical(body: bytes) -> bytes:
    """A JSON body as the same JSON whatever its spacing and key order (clients serialize alike
    bodies differently: the official client's retry and a script's raw request); any other
    body as it is."""
    try:
        return json_text.dumps(json_text.loads(body), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return body


def _boundary() -> bytes | None:
    mimetype, options = parse_options_header(request.content_type or "")
    boundary = options.get("boundary") if mimetype.startswith("multipart/") else None
    return ("--" + boundary).encode("latin-1") if boundary else None


class _HashingReader:
    """``read()`` of a stream that hashes what passes, with every ``boundary`` taken out (a
    multipart delimiter, ``--`` and the boundary: random per request, not part of its content)."""

    def __init__(self, stream: IO[bytes], sha: Any, boundary: bytes | None) -> None:
        self._stream = stream
        self._sha = sha
        self._boundary = boundary
        self._held = b""  # the end of what was read, which may be the start of a boundary
        self.hashed = 0  # bytes hashed (boundaries left out)
        self._mark: int | None = None
        self.at_mark: str | None = None  # the digest once ``_mark`` bytes were hashed

    def so_far(self) -> tuple[str, int]:
        """The digest of what was read, and how many bytes that is (boundaries left out). The
        bytes held count: they are past the part a create has just read whole (a file's), so a
        body that goes on differently after it is another request. (Held bytes that begin a
        boundary would make a retry of the same request a 409: only when a read ended inside the
        boundary of a part after that one.)"""
        sha = self._sha.copy()
        sha.update(self._held)
        return sha.hexdigest(), self.hashed + len(self._held)

    def mark(self, size: int) -> None:
        """Keep the digest as it is once ``size`` bytes are hashed, in ``at_mark``."""
        self._mark = size
        if size == self.hashed:
            self.at_mark = self._sha.hexdigest()

    def read(self, size: int | None = -1) -> bytes:
        data = self._stream.read(-1 if size is None else size)
        if self._boundary is None:
            self._hash(data)
            return data
        pending = (self._held + data).replace(self._boundary, b"")
        keep = 0 if not data else len(self._boundary) - 1  # at the end, nothing more can follow
        cut = max(len(pending) - keep, 0)
        self._hash(pending[:cut])
        self._held = pending[cut:]
        return data

    def _hash(self, data: bytes) -> None:
        if self._mark is not None and self.hashed < self._mark <= self.hashed + len(data):
            head = self._mark - self.hashed
            self._sha.update(data[:head])
            self.at_mark = self._sha.hexdigest()
            data, self.hashed = data[head:], self._mark
        self._sha.update(data)
        self.hashed += len(data)
