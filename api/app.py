"""The Flask application factory. Nothing here touches the network, disk or database at import."""

from __future__ import annotations

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import NotFound, RequestEntityTooLarge

from api.auth import check_metrics_access, on_metrics_listener
from api.errors import PART_ENDPOINT, UPLOAD_ENDPOINTS, register_error_handlers
from api.metrics import register_metrics
from api.openapi import openapi_document
from api.proxies import TrustedProxies
from api.ratelimit import register_rate_limits
from api.request_ids import RequestIds
from api.request_spans import register_request_spans
from api.serializers import readiness_object
from api.services.readiness import ReadinessProbe
from api.services.uploads import MAX_PART_BYTES
from storage.errors import ServiceError
from storage.runtime import Runtime
from storage.settings import Settings

# the metrics listener (FREIGHT_METRICS_BIND, a private interface) serves what monitoring reads:
# the metrics and both probes, nothing of tenants'
METRICS_LISTENER_ENDPOINTS = frozenset({"metrics", "healthz", "readyz"})


def create_app(settings: Settings | None = None, runtime: Runtime | None = None) -> Flask:
    settings = settings or (runtime.settings if runtime else Settings.from_env())
    app = Flask(__name__)
    # the multipart envelope around a maximal file needs a little room
    app.config["MAX_CONTENT_LENGTH"] = settings.max_file_bytes + 1024 * 1024
    app.config["SECRET_KEY"] = settings.secret_key or None
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["freight"] = runtime or Runtime(settings)
    readiness = ReadinessProbe(app.extensions["freight"])
    readiness.build_clients()  # CPU only: connects nothing until the first probe
    app.extensions["freight_readiness"] = readiness  # /metrics reports its checks too
    if settings.trusted_proxies:
        app.wsgi_app = TrustedProxies(app.wsgi_app, settings.trusted_proxies)  # type: ignore[method-assign]
    # outermost: every response has its x-request-id, whatever answered it
    app.wsgi_app = RequestIds(app.wsgi_app)  # type: ignore[method-assign]
    register_error_handlers(app)
    register_request_spans(app)  # first: its span covers every other hook

    @app.before_request
    def _screen() -> None:
        """Before any view or rate limit: hold non-upload bodies to the small limit (werkzeug cuts
        the stream there, declared length or not), refuse NUL in the URL (no database stores it),
        keep /metrics to its scrapers, and the metrics listener to /metrics."""
        if request.endpoint == PART_ENDPOINT:
            request.max_content_length = MAX_PART_BYTES + 1024 * 1024
        elif request.endpoint not in UPLOAD_ENDPOINTS:
            limit = settings.max_json_body_bytes
            chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
            if chunked and request.content_length is None and "wsgi.input_terminated" in request.environ:
                # chunked: werkzeug would hand on the first `limit` bytes as if they were all, so
                # read it here (bounded, cached for the view) and refuse what goes past the limit
                request.max_content_length = limit + 1
                if len(request.get_data()) > limit:
                    raise RequestEntityTooLarge()
            request.max_content_length = limit
        if "\x00" in request.path or any("\x00" in k + v for k, v in request.args.items(multi=True)):
            raise ServiceError(
                "invalid_request", "NUL characters are not allowed in URLs", code="invalid_url"
            )
        if on_metrics_listener(settings) and request.endpoint not in METRICS_LISTENER_ENDPOINTS:
            raise NotFound()  # the metrics listener serves nothing of tenants'
        if request.endpoint == "metrics":
            check_metrics_access(settings)

    register_rate_limits(app, settings)

    import api.views.console_usage  # its routes join the console's blueprint
    import api.views.console_webhooks  # noqa: F401 (its routes join the console's blueprint)
    from api.views.console import bp as console
    from api.views.v1 import bp as v1
    from api.views.webhooks import bp as webhooks

    app.register_blueprint(v1)
    app.register_blueprint(webhooks)
    app.register_blueprint(console)
    register_metrics(app)

    @app.get("/healthz")
    def healthz() -> Response:
        """Liveness: the process answers. Touches nothing else, so an outage elsewhere never gets
        a healthy API process restarted."""
        return jsonify({"status": "ok"})

    @app.get("/readyz")
    def readyz() -> tuple[Response, int]:
        """Readiness: 200 when the database, the broker and the object store answer, else 503
        naming the ones that did not (api/services/readiness.py). No key, like /healthz."""
        result = readiness.check()
        response = jsonify(readiness_object(result))
        response.headers["Cache-Control"] = "no-store"
        return response, 200 if result.ready else 503

    @app.get("/openapi.json")
    def openapi() -> Response:
        return jsonify(openapi_document(settings))

    return app
