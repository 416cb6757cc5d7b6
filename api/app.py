"""The Flask application factory. Nothing here touches the network, disk or database at import."""

from __future__ import annotations

import logging

from flask import Flask, jsonify

from api.errors import register_error_handlers
from api.metrics import register_metrics
from storage.settings import Settings
from workers.runtime import Runtime


def create_app(settings: Settings | None = None, runtime: Runtime | None = None) -> Flask:
    settings = settings or (runtime.settings if runtime else Settings.from_env())
    app = Flask(__name__)
    # the multipart envelope around a maximal file needs a little room
    app.config["MAX_CONTENT_LENGTH"] = settings.max_file_bytes + 1024 * 1024
    app.config["SECRET_KEY"] = settings.secret_key or None
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["freight"] = runtime or Runtime(settings)
    register_error_handlers(app)

    from api.views.console import bp as console
    from api.views.v1 import bp as v1

    app.register_blueprint(v1)
    app.register_blueprint(console)
    register_metrics(app)

    @app.get("/healthz")
    def healthz():  # type: ignore[no-untyped-def]
        return jsonify({"status": "ok"})

    logging.getLogger("freight").setLevel(logging.INFO)
    return app
