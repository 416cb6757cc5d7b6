"""The API tests' app and client: the Flask app over the test's runtime (real database, store and
broker: tests/conftest.py), and a test client of it. A module whose app needs other settings or a
model registered first defines its own ``app`` (pytest takes the nearest fixture), and ``client``
follows it."""

from __future__ import annotations

import pytest
from flask import Flask
from flask.testing import FlaskClient

from api.app import create_app
from storage.runtime import Runtime


@pytest.fixture
def app(runtime: Runtime) -> Flask:
    return create_app(runtime=runtime)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()
