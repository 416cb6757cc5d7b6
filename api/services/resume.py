"""Resuming a batch, the API's half (issue #48 part 3): ``POST /v1/batches`` with a top-level
``resume_from: BATCH_ID`` (``extra_body`` in the official client; ``freight resume``) makes a new
batch of the lines the earlier batch left without a result worth keeping.

This half checks that the earlier batch can be resumed and fills the create request from it (its
input file, endpoint and metadata, whose ``default_*`` shape its lines); the new batch is made by
``workers.intake`` like any other, and validation and finalization do the rest
(``workers.resume``). A batch can be resumed once it has ended (completed, failed after it ran,
expired, cancelled), while its result files are kept, when some line of it is worth running again
(``workers.results.worth_retrying``: it never ran, or the engine failed, timed out or was rate
limited; a 4xx is not retried); another tenant's batch is not found, as one that does not exist.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy.orm import Session

from api.services.batches import owned
from storage.errors import ServiceError
from storage.models import Batch, StoredFile
from storage.objectstore import iter_lines
from storage.retention import live
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers.intake import storable
from workers.results import worth_retrying

PARAM = "resume_from"


def prepare(rt: Runtime, tenant_id: str, payload: Any) -> tuple[Any, str | None]:
    """The create body with what a resume takes from the earlier batch filled in, and that batch's
    id (None: not a resume, the body as given). Refusals: 404 for a batch not the tenant's, 400
    naming the reason for one that cannot be resumed."""
    if not isinstance(payload, dict) or payload.get(PARAM) is None:
        return payload, None
    earlier_id = payload[PARAM]
    if not isinstance(earlier_id, str) or not earlier_id:
        raise ServiceError("invalid_request", f"{PARAM} must be a batch id", param=PARAM)
    if not storable(earlier_id) or len(earlier_id) > 40:  # no row has such an id
        raise ServiceError("not_found", f"No such Batch object: {earlier_id[:100]!r}", param=PARAM)
    with rt.db.read() as s:
        earlier = owned(s, tenant_id, earlier_id)
        error_key = _result_keys(s, earlier)
    _check_ended(earlier)
    if error_key is not None or earlier.status != BatchStatus.FAILED:
        _check_something_left(rt, earlier, error_key)
    filled = dict(payload)
    for field, value in (("input_file_id", earlier.input_file_id), ("endpoint", earlier.endpoint)):
        given = filled.setdefault(field, value)
        if given != value:
            raise ServiceError(
                "invalid_request",
                f"a resume runs the {field} of the batch it resumes ({value}); {field} may be omitted",
                param=field,
            )
    if filled.get("metadata") is None and earlier.metadata_:
        filled["metadata"] = earlier.metadata_  # its default_* shape the lines as they ran
    return filled, earlier.id


def _check_ended(earlier: Batch) -> None:
    status = BatchStatus(earlier.status)
    if status not in BatchStatus.FINAL:
        raise ServiceError(
            "invalid_request",
            f"batch {earlier.id} is {status.value}: only a batch that has ended (completed, failed,"
            " expired or cancelled) can be resumed; wait for it, or cancel it first",
            param=PARAM,
            code="batch_not_resumable",
        )
    if status == BatchStatus.FAILED and earlier.in_progress_at is None:
        raise ServiceError(
            "invalid_request",
            f"batch {earlier.id} failed before any line ran (see its errors): fix the input file and"
            " create a new batch",
            param=PARAM,
            code="nothing_to_resume",
        )


def _result_keys(s: Session, earlier: Batch) -> str | None:
    """The object key of the earlier batch's error file (None: it has none). A result file that
    was deleted or expired is a refusal: the lines it held could be neither skipped nor kept."""
    now = time.time()
    error_key = None
    for file_id in (earlier.output_file_id, earlier.error_file_id):
        if file_id is None:
            continue
        record = s.get(StoredFile, file_id)
        if record is None or not live(record, now):
            raise ServiceError(
                "invalid_request",
                f"batch {earlier.id}'s result file {file_id} was deleted or has expired: a resume keeps"
                " the results it holds, so it cannot be made",
                param=PARAM,
                code="batch_not_resumable",
            )
        if file_id == earlier.error_file_id:
            error_key = record.object_key
    return error_key


def _check_something_left(rt: Runtime, earlier: Batch, error_key: str | None) -> None:
    """Refuse when no line of the earlier batch is worth running again: read its error file up to
    the first line that is (a cancelled or expired batch's first unrun line comes soon)."""
    if error_key is not None:
        with rt.store.open(error_key) as stream:
            for raw in iter_lines(stream):
                if raw.strip() and worth_retrying(json.loads(raw)):
                    return
    reason = (
        "every line of it has a result"
        if error_key is None
        else "its failed lines failed for reasons a retry would not change (their requests were"
        " refused with a 4xx: fix them in a new file)"
    )
    raise ServiceError(
        "invalid_request",
        f"batch {earlier.id} has nothing to resume: {reason}",
        param=PARAM,
        code="nothing_to_resume",
    )
