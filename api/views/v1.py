"""The OpenAI-compatible /v1 routes: files, uploads (a file in parts), batches, models."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, g, jsonify, request

from api.auth import require_tenant
from api.idempotency import idempotent
from api.multipart import open_upload
from api.serializers import (
    adapter_object,
    batch_object,
    estimate_object,
    file_object,
    list_object,
    model_object,
    upload_object,
    upload_part_object,
)
from api.services import batches, estimates, files, models, results, resume, uploads
from api.services.paging import parse_limit
from storage.adapters import AdapterEntry
from storage.errors import ServiceError
from storage.runtime import Runtime
from workers import intake
from workers.conversions import Preparing

bp = Blueprint("v1", __name__, url_prefix="/v1")


def rt() -> Runtime:
    return current_app.extensions["freight"]


def json_body() -> object:
    try:
        body = request.get_json(silent=True)
    except RecursionError:  # nested deeper than the JSON decoder recurses
        raise ServiceError("invalid_request", "the request body is nested too deeply") from None
    if body is None:
        raise ServiceError(
            "invalid_request", "the request body must be JSON (Content-Type: application/json)"
        )
    return body


@bp.post("/files")
@require_tenant
@idempotent
def upload_file() -> Response:
    form = open_upload(request.stream, request.content_type)  # the file part streams to the store
    if form.file is None:
        raise ServiceError("invalid_request", "multipart field 'file' is required", param="file")
    if "purpose" not in form.fields:
        form.spool(rt().settings.max_file_bytes)  # the file came first: read on to find the purpose
    seen = expires_after_field(form.fields)
    record = intake.upload(rt(), g.tenant_id, form.fields.get("purpose"), form.filename, form.file, seen)
    form.finish()
    if seen is None and (late := expires_after_field(form.fields)) is not None:  # sent after the file
        record = intake.set_expiry(rt(), g.tenant_id, record.id, late)
    return jsonify(file_object(record))


def expires_after_field(fields: dict[str, str]) -> int | None:
    """OpenAI's form fields ``expires_after[anchor]`` and ``expires_after[seconds]``, checked."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    return intake.check_expires_after({"anchor": anchor, "seconds": seconds}, "expires_after")


@bp.get("/files")
@require_tenant
def list_files() -> Response:
    limit = parse_limit(request.args.get("limit"), default=100, maximum=10_000)
    result = files.list_files(
        rt(), g.tenant_id, request.args.get("purpose"), request.args.get("after"), limit
    )
    return jsonify(list_object(result, file_object))


@bp.get("/files/<file_id>")
@require_tenant
def get_file(file_id: str) -> Response:
    return jsonify(file_object(files.get(rt(), g.tenant_id, file_id)))


@bp.get("/files/<file_id>/content")
@require_tenant
def file_content(file_id: str) -> Response:
    content = files.download(
        rt(), g.tenant_id, file_id, request.args.get("format"), request.args.get("order")
    )
    if isinstance(content, Preparing):  # the control worker converts it: ask again later
        preparing = jsonify(
            {
                "object": "file.content",
                "id": file_id,
                "format": content.format,
                "status": "preparing",
                "message": f"the file is being converted to {content.format}; "
                f"ask again in {content.retry_after} seconds",
            }
        )
        preparing.status_code = 202
        preparing.headers["Retry-After"] = str(content.retry_after)
        return preparing
    response = Response(content.chunks, mimetype=content.mimetype)
    if content.size is not None:
        response.headers["Content-Length"] = str(content.size)
    response.headers["Content-Disposition"] = f'attachment; filename="{content.filename}"'
    return response


@bp.delete("/files/<file_id>")
@require_tenant
def delete_file(file_id: str) -> Response:
    record = files.delete(rt(), g.tenant_id, file_id)
    return jsonify({"id": record.id, "object": "file", "deleted": True})


@bp.post("/uploads")
@require_tenant
@idempotent
def create_upload() -> Response:
    return jsonify(upload_object(uploads.create(rt(), g.tenant_id, json_body())))


@bp.post("/uploads/<upload_id>/parts")
@require_tenant
@idempotent
def add_upload_part(upload_id: str) -> Response:
    uploads.get(rt(), g.tenant_id, upload_id)  # another tenant's upload: 404 before reading the body
    form = open_upload(request.stream, request.content_type, "data")  # the part streams to the store
    part = uploads.add_part(rt(), g.tenant_id, upload_id, form.file)
    form.finish()
    return jsonify(upload_part_object(part))


@bp.post("/uploads/<upload_id>/complete")
@require_tenant
@idempotent
def complete_upload(upload_id: str) -> Response:
    upload, record = uploads.complete(rt(), g.tenant_id, upload_id, json_body())
    return jsonify(upload_object(upload, record))


@bp.post("/uploads/<upload_id>/cancel")
@require_tenant
def cancel_upload(upload_id: str) -> Response:
    return jsonify(upload_object(uploads.cancel(rt(), g.tenant_id, upload_id)))


@bp.post("/batches")
@require_tenant
@idempotent
def create_batch() -> Response:
    payload = json_body()
    dry_run = estimates.dry_run_requested(payload)
    payload, earlier = resume.prepare(rt(), g.tenant_id, payload)  # resume_from: the lines it left
    if dry_run:  # a price before the run: nothing is made or run
        return jsonify(estimate_object(estimates.create(rt(), g.tenant_id, payload, earlier)))
    return jsonify(batch_object(intake.create(rt(), g.tenant_id, payload, earlier)))


@bp.get("/batches")
@require_tenant
def list_batches() -> Response:
    limit = parse_limit(request.args.get("limit"))
    result, running = batches.list_batches(rt(), g.tenant_id, request.args.get("after"), limit)
    return jsonify(list_object(result, lambda b: batch_object(b, running.get(b.id, (0, 0)))))


@bp.get("/batches/<batch_id>")
@require_tenant
def get_batch(batch_id: str) -> Response:
    if batch_id.startswith(estimates.ID_PREFIX):  # a dry run is polled where a batch would be
        return jsonify(estimate_object(estimates.get(rt(), g.tenant_id, batch_id)))
    batch, running = batches.get_with_progress(rt(), g.tenant_id, batch_id)
    return jsonify(batch_object(batch, running))


@bp.get("/batches/<batch_id>/results")
@require_tenant
def batch_results(batch_id: str) -> Response:
    """Freight's extension: the lines of the units recorded so far, after the cursor ``after``."""
    args = request.args
    found = results.partial(
        rt(), g.tenant_id, batch_id, kind=args.get("kind"), after=args.get("after"),
        fmt=args.get("format"), order=args.get("order"),
    )  # fmt: skip
    response = Response(found.chunks, mimetype=found.mimetype)
    if found.size is not None:
        response.headers["Content-Length"] = str(found.size)
    response.headers["Content-Disposition"] = f'attachment; filename="{found.filename}"'
    response.headers[results.CURSOR_HEADER] = found.next_cursor or ""
    response.headers[results.COMPLETE_HEADER] = "true" if found.complete else "false"
    return response


@bp.post("/batches/<batch_id>/cancel")
@require_tenant
def cancel_batch(batch_id: str) -> Response:
    return jsonify(batch_object(batches.cancel(rt(), g.tenant_id, batch_id)))


@bp.get("/models")
@require_tenant
def list_models() -> Response:
    served = [model_object(e) for e in models.list_models(rt())]
    loras = [adapter_object(a) for a in models.list_adapters(rt(), g.tenant_id)]
    return jsonify({"object": "list", "data": served + loras})


@bp.get("/models/<path:model>")
@require_tenant
def get_model(model: str) -> Response:
    entry = models.get(rt(), model, g.tenant_id)
    return jsonify(adapter_object(entry) if isinstance(entry, AdapterEntry) else model_object(entry))
