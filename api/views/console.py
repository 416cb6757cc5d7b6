"""The web console: server-rendered pages over the same services as /v1, for one signed-in tenant.

Sign-in takes an API key and starts a server-side session (``api/services/sessions.py``); Flask's
signed cookie (HttpOnly, SameSite=Lax, Secure over HTTPS, FREIGHT_SESSION_SECONDS long) holds only
that session's random token and the CSRF token, nothing of the key. Every request checks the
session on the server, so sign-out, revoking the key and disabling the tenant end it at once, and
a request without a live session is turned away before its body is read (an upload of 200 MB
included). Every POST carries the session's CSRF token. Pages refresh themselves (meta refresh)
while something on them still runs; charts are inline SVG drawn here, so nothing is fetched from
anywhere but Freight (a Content-Security-Policy of 'self' enforces it). Errors are HTML pages.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from datetime import timedelta
from typing import Any, cast

from flask import (
    Blueprint,
    Flask,
    Response,
    current_app,
    flash,
    g,
    has_request_context,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask.blueprints import BlueprintSetupState
from flask.sessions import SecureCookieSessionInterface
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from api.auth import console_session
from api.console_format import chart, register_filters
from api.errors import DB_RETRY_AFTER_SECONDS, status_of
from api.serializers import batch_object
from api.services import batches, console, files, models, results, sessions, webhooks
from api.services.tenants import authenticate_key
from storage.broker import BROKER_ERRORS
from storage.errors import ServiceError
from storage.objectstore import ObjectStoreError
from storage.runtime import Runtime
from storage.status import BatchStatus
from workers.request_bodies import ENDPOINTS, POOLING_ENDPOINTS

log = logging.getLogger(__name__)
bp = Blueprint("console", __name__, url_prefix="/console")

REFRESH_SECONDS = 5
PUBLIC = {"console.sign_in", "console.sign_in_post"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
    "script-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class ConsoleError(Exception):
    """A console request refused, shown as an HTML page with ``status`` (4xx, or 503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def rt() -> Runtime:
    return current_app.extensions["freight"]


class SessionCookies(SecureCookieSessionInterface):
    """Flask's signed cookie, marked ``Secure`` whenever the request came over HTTPS (directly,
    or as a trusted proxy's X-Forwarded-Proto says): the same deployment may be reached both ways."""

    def get_cookie_secure(self, app: Flask) -> bool:
        return request.is_secure if has_request_context() else super().get_cookie_secure(app)


@bp.record_once
def _setup(state: BlueprintSetupState) -> None:
    app = cast(Flask, state.app)  # the blueprint is registered on Freight's Flask app
    settings = app.extensions["freight"].settings
    if not app.secret_key:
        app.secret_key = console.session_secret(settings)
    app.session_interface = SessionCookies()
    app.config.update(
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        # the cookie's own age limit (its signature is refused after it) matches the server's
        PERMANENT_SESSION_LIFETIME=timedelta(seconds=settings.session_seconds),
    )
    register_filters(app)
    app.add_url_rule("/", "console_root", lambda: redirect(url_for("console.jobs_page")))


# --- session, CSRF, errors ------------------------------------------------------------------------


def csrf_token() -> str:
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(32)
    return session["csrf"]


@bp.context_processor
def _context() -> dict[str, Any]:
    return {"csrf_token": csrf_token, "now": time.time()}


@bp.before_request
def _guard() -> ResponseReturnValue | None:
    if not current_app.secret_key:
        raise ConsoleError(
            503, "The console is off: set FREIGHT_SECRET_KEY (or make the data folder writable)."
        )
    if request.endpoint not in PUBLIC:
        # the session first, the form (CSRF) after: a request nobody signed in sent is turned
        # away before any of its body is read or parsed
        signed_in = console_session()
        if signed_in is None:
            session.pop("sid", None)
            target = request.full_path if request.method == "GET" else None
            return redirect(url_for(".sign_in", next=target))
        g.tenant_id, g.tenant_name = signed_in.tenant_id, signed_in.tenant_name
    if request.method == "POST":
        sent = request.form.get("csrf_token", "")
        if not sent or not hmac.compare_digest(sent, session.get("csrf", "")):
            raise ConsoleError(
                400, "This form has expired or came from another site; reload the page and retry."
            )
    return None


@bp.after_request
def _headers(response: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def error_page(status: int, message: str) -> tuple[str, int]:
    return render_template("console/error.html", status=status, message=message), status


@bp.errorhandler(ConsoleError)
def _console_error(exc: ConsoleError) -> tuple[str, int]:
    return error_page(exc.status, exc.message)


@bp.errorhandler(ServiceError)
def _service_error(exc: ServiceError) -> tuple[str, int]:
    return error_page(status_of(exc), exc.message)


@bp.errorhandler(HTTPException)
def _http_error(exc: HTTPException) -> tuple[str, int]:
    status = exc.code or 400
    message = {
        404: "There is no such page.",
        413: "The file is larger than this deployment accepts.",
    }.get(status, exc.description or exc.name)
    return error_page(status, message)


@bp.errorhandler(Exception)
def _unexpected(exc: Exception) -> tuple[str, int]:
    log.exception("console: unhandled error")
    return error_page(500, "Internal error; it has been logged.")


@bp.errorhandler(ObjectStoreError)
def _store_error(exc: ObjectStoreError) -> tuple[str, int]:
    log.error("object store unavailable: %s", exc)
    return error_page(503, "The object store is unavailable; retry shortly.")


def _broker_error(exc: Exception) -> tuple[str, int, dict[str, str]]:
    """The job queue could not be reached: nothing was created (intake withdraws the batch)."""
    log.error("job queue unavailable: %s", exc)
    page, status = error_page(503, "The job queue is unavailable; nothing was created. Retry shortly.")
    return page, status, {"Retry-After": str(DB_RETRY_AFTER_SECONDS)}


for _broker_exc in BROKER_ERRORS:
    bp.register_error_handler(_broker_exc, _broker_error)


# --- sign-in ----------------------------------------------------------------------------------------


def _next_url() -> str:
    target = request.values.get("next") or ""
    if target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return url_for(".jobs_page")


@bp.get("/sign-in")
def sign_in() -> str:
    return render_template("console/sign_in.html", next=request.args.get("next", ""))


@bp.post("/sign-in")
def sign_in_post() -> ResponseReturnValue:
    key = request.form.get("api_key", "").strip()
    found = authenticate_key(rt().db, key) if key and len(key) <= 200 else None
    if found is None:
        page = render_template("console/sign_in.html", next=_next_url(), error="Incorrect API key.")
        return page, 401
    target = _next_url()
    tenant_id, key_id = found
    settings = rt().settings
    token = sessions.start(rt().db, tenant_id, key_id, int(time.time()), settings.session_seconds,
                           settings.max_sessions_per_tenant)  # fmt: skip
    session.clear()  # a fresh session (and CSRF token) for the signed-in tenant
    session.update(sid=token, csrf=secrets.token_urlsafe(32))
    session.permanent = True  # the cookie expires with the server's session
    return redirect(target)


@bp.post("/sign-out")
def sign_out() -> ResponseReturnValue:
    sessions.end(rt().db, session.get("sid"))  # a kept copy of the cookie is worth nothing now
    session.clear()
    flash("Signed out.")
    return redirect(url_for(".sign_in"))


# --- jobs -------------------------------------------------------------------------------------------


def _int_arg(name: str, default: int, maximum: int) -> int:
    raw = request.args.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ConsoleError(400, f"{name} must be a whole number") from None
    if not 1 <= value <= maximum:
        raise ConsoleError(400, f"{name} must be from 1 to {maximum}")
    return value


def job_view(
    b: Any, filename: str | None = None, running: tuple[int, int] = (0, 0), stopped: int = 0
) -> dict[str, Any]:
    """The batch's wire object (the API's own numbers, with its running units' counts so far)
    plus what the pages show beside it. ``stopped``: of the failed requests, those a cancel or the
    window's end kept from running, so a stopped job's bar shows what finished before the stop."""
    view = batch_object(b, running)
    counts = view["request_counts"]
    view["filename"] = filename
    view["done"] = counts["completed"] + counts["failed"]
    view["stopped"] = min(stopped, counts["failed"])
    view["stopped_as"] = (
        "expired" if b.final_status == BatchStatus.EXPIRED and not b.cancelling_at else "cancelled"
    )
    view["final"] = BatchStatus(b.status).is_terminal
    view["cancellable"] = b.status in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
    # embeddings, scores: it writes no tokens, input is the whole cost
    view["embeddings"] = b.endpoint in POOLING_ENDPOINTS
    return view


@bp.get("/")
@bp.get("/jobs")
def jobs_page() -> str:
    status = request.args.get("status") or None
    model = request.args.get("model") or None
    query = request.args.get("q", "").strip() or None
    per_page = _int_arg("per_page", 20, 100)
    page = _int_arg("page", 1, 1_000_000)
    result = console.jobs(rt(), g.tenant_id, status, model, page, per_page, query)
    views = [job_view(r.batch, r.filename, r.running, r.stopped) for r in result.rows]
    return render_template(
        "console/jobs.html",
        jobs=views,
        result=result,
        status=status or "",
        model=model or "",
        q=query or "",
        statuses=console.STATUS_FILTERS,
        models=console.tenant_models(rt(), g.tenant_id),
        refresh=REFRESH_SECONDS if any(not v["final"] for v in views) else None,
    )


@bp.get("/jobs/<batch_id>")
def job_page(batch_id: str) -> str:
    detail = console.job(rt(), g.tenant_id, batch_id, time.time())
    filename = detail.input_file.filename if detail.input_file else None
    view = job_view(detail.batch, filename, detail.running, detail.stopped)
    return render_template(
        "console/job.html",
        job=view,
        timeline=detail.timeline,
        chart=chart(detail.throughput),
        deliveries=webhooks.deliveries(rt(), g.tenant_id, batch_id=batch_id) if view["final"] else [],
        refresh=None if view["final"] else REFRESH_SECONDS,
    )


@bp.post("/jobs/<batch_id>/cancel")
def cancel(batch_id: str) -> ResponseReturnValue:
    batch = batches.cancel(rt(), g.tenant_id, batch_id)
    flash(f"Batch {batch.id} is {batch.status}.")
    return redirect(url_for(".job_page", batch_id=batch.id))


@bp.get("/jobs/<batch_id>/files/<kind>")
def download(batch_id: str, kind: str) -> Response:
    batch = batches.get(rt(), g.tenant_id, batch_id)
    file_id = {"input": batch.input_file_id, "output": batch.output_file_id, "errors": batch.error_file_id}
    if not file_id.get(kind):
        raise ConsoleError(404, f"Batch {batch.id} has no {kind} file (yet).")
    record, chunks = files.content(rt(), g.tenant_id, file_id[kind])  # type: ignore[arg-type]
    response = Response(chunks, mimetype="application/jsonl")
    response.headers["Content-Length"] = str(record.bytes)
    response.headers["Content-Disposition"] = f'attachment; filename="{batch.id}.{kind}.jsonl"'
    return response


@bp.get("/jobs/<batch_id>/results")
def results_so_far(batch_id: str) -> Response:
    """The output lines of the job's units recorded so far (``GET /v1/batches/{id}/results``)."""
    found = results.partial(rt(), g.tenant_id, batch_id, kind=request.args.get("kind"))
    response = Response(found.chunks, mimetype=found.mimetype)
    response.headers["Content-Disposition"] = f'attachment; filename="{found.filename}"'
    return response


# --- upload -----------------------------------------------------------------------------------------


def _metadata(text: str) -> dict[str, str] | None:
    pairs: dict[str, str] = {}
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ServiceError("invalid_request", f"metadata lines are key=value, got {line[:80]!r}")
        pairs[key.strip()] = value.strip()
    return pairs or None


def _upload_form(error: str | None = None, status: int = 200) -> tuple[str, int]:
    settings = rt().settings
    form = request.form
    page = render_template(
        "console/upload.html",
        endpoints=ENDPOINTS,
        models=[m.name for m in console.served_models(rt())],
        windows=settings.sla_tiers,
        chosen={
            "endpoint": form.get("endpoint", ENDPOINTS[0]),
            "model": form.get("model", ""),
            "window": form.get("window", settings.default_window),
            "metadata": form.get("metadata", ""),
        },
        error=error,
    )
    return page, status


@bp.get("/upload")
def upload() -> tuple[str, int]:
    return _upload_form()


@bp.post("/upload")
def upload_post() -> ResponseReturnValue:
    chosen = request.files.get("file")
    if chosen is None or not chosen.filename:
        return _upload_form("Choose a JSONL file to upload.", 400)
    try:
        batch = console.submit(
            rt(),
            g.tenant_id,
            chosen.filename,
            chosen.stream,
            request.form.get("endpoint", ""),
            request.form.get("model") or None,
            request.form.get("window", ""),
            _metadata(request.form.get("metadata", "")),
        )
    except ServiceError as exc:
        return _upload_form(exc.message, status_of(exc))
    flash(f"Uploaded {chosen.filename} and created batch {batch.id}.")
    return redirect(url_for(".job_page", batch_id=batch.id))


# --- models and workers -------------------------------------------------------------------------


@bp.get("/models")
def models_page() -> str:
    """The served models; for an operator (FREIGHT_CONSOLE_OPERATORS) every model's queues and the
    engine workers' host names and load, for any other tenant only its own queued work and ETAs."""
    operator = console.is_operator(rt().settings, g.tenant_name)
    queues = console.queues(rt()) if operator else []
    workers = console.live_workers(rt(), time.time()) if operator else []
    own = [] if operator else console.own_work(rt(), g.tenant_id)
    busy = any(q.batches or any(q.units.values()) for q in queues) or bool(own)
    return render_template(
        "console/models.html",
        models=console.served_models(rt()),
        adapters=models.list_adapters(rt(), g.tenant_id),  # the LoRA adapters this tenant may use
        operator=operator,
        queues=queues,
        workers=workers,
        own=own,
        refresh=REFRESH_SECONDS if busy else None,
    )


@bp.route("/<path:unknown>")
def not_found(unknown: str) -> ResponseReturnValue:
    raise ConsoleError(404, "There is no such page.")
