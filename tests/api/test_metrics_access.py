"""Who is "local": /metrics wants its token (or its own listener), whatever address the request
seems to come from, and X-Forwarded-For / X-Forwarded-Proto count only from listed proxies.
Flask's test client on SQLite and PostgreSQL, with the rate limits' real Redis."""

from __future__ import annotations

from dataclasses import replace

import pytest

from api.app import create_app
from api.proxies import TrustedProxies
from api.services.tenants import create_tenant
from storage.runtime import Runtime
from storage.settings import Settings, SettingsError
from tests.conftest import now

TOKEN = "scrape-me"
METRICS_PORT = 9108
PROXY = {"REMOTE_ADDR": "127.0.0.1"}  # a reverse proxy on the same host: every client is loopback


def app_with(settings: Settings, **changes):
    rt = Runtime(replace(settings, **changes))
    return create_app(runtime=rt), rt


@pytest.fixture
def apps():
    made: list[Runtime] = []

    def make(settings: Settings, **changes):
        app, rt = app_with(settings, **changes)
        made.append(rt)
        return app

    yield make
    for rt in made:
        rt.db.dispose()


def test_metrics_from_loopback_behind_a_proxy_needs_the_token(settings, apps) -> None:
    app = apps(settings, metrics_token=TOKEN, trusted_proxies=("127.0.0.1",))
    client = app.test_client()
    forwarded = {"X-Forwarded-For": "127.0.0.1"}  # even a client that claims to be the host itself
    assert client.get("/metrics", environ_base=PROXY, headers=forwarded).status_code == 401
    assert client.get("/metrics", environ_base=PROXY).status_code == 401
    ok = client.get("/metrics", environ_base=PROXY, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and b"freight_batches" in ok.data
    # and with no token configured, /metrics answers no one on the main listener
    bare = apps(settings).test_client()
    refused = bare.get("/metrics", environ_base=PROXY)
    assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "metrics_forbidden"


def test_the_metrics_listener_serves_metrics_and_nothing_else(settings, apps) -> None:
    app = apps(settings, metrics_bind=f"127.0.0.1:{METRICS_PORT}")
    _, key = create_tenant(app.extensions["freight"].db, "beta", now())
    listener = app.test_client()
    at_listener = {"SERVER_PORT": str(METRICS_PORT)}
    scraped = listener.get("/metrics", environ_overrides=at_listener)
    assert scraped.status_code == 200 and b"freight_batches" in scraped.data
    assert listener.get("/healthz", environ_overrides=at_listener).status_code == 200
    # readiness too (database, Redis and SeaweedFS of the test services answer), with its body
    ready = listener.get("/readyz", environ_overrides=at_listener)
    assert ready.status_code == 200 and ready.get_json()["status"] == "ready", ready.get_json()
    bearer = {"Authorization": f"Bearer {key}"}
    assert listener.get("/v1/models", headers=bearer, environ_overrides=at_listener).status_code == 404
    assert listener.get("/console/sign-in", environ_overrides=at_listener).status_code == 404
    # the main listener (another port, whatever the Host header says) still wants a token
    main = app.test_client()
    assert main.get("/metrics").status_code == 403
    spoofed = main.get("/metrics", headers={"Host": f"127.0.0.1:{METRICS_PORT}"})
    assert spoofed.status_code == 403
    assert main.get("/v1/models", headers=bearer).status_code == 200


def test_metrics_bind_is_checked() -> None:
    for bad in ("9108", "host:", "host:99999", "127.0.0.1:8080"):
        with pytest.raises(SettingsError, match="FREIGHT_METRICS_BIND"):
            Settings.from_env({"FREIGHT_METRICS_BIND": bad})
    assert Settings.from_env({"FREIGHT_METRICS_BIND": "[::1]:9108"}).metrics_bind == "[::1]:9108"
    with pytest.raises(SettingsError, match="FREIGHT_TRUSTED_PROXIES"):
        Settings.from_env({"FREIGHT_TRUSTED_PROXIES": "10.0.0.0/8,proxy.example"})
    assert Settings.from_env({"FREIGHT_TRUSTED_PROXIES": "10.0.0.0/8, ::1"}).trusted_proxies == (
        "10.0.0.0/8",
        "::1",
    )


def anonymous_statuses(client, peer: str, forwarded: list[str]) -> list[int]:
    """Statuses of key-less requests from ``peer``, one per X-Forwarded-For value."""
    return [
        client.get(
            "/v1/models", environ_base={"REMOTE_ADDR": peer}, headers={"X-Forwarded-For": f}
        ).status_code
        for f in forwarded
    ]


def test_forwarded_for_is_ignored_from_an_untrusted_peer(settings, apps) -> None:
    # two anonymous requests per bucket, nearly no refill: the third from one address is a 429
    app = apps(
        settings, rate_limit_anonymous_rps=0.001, rate_limit_anonymous_burst=2, trusted_proxies=("10.0.0.1",)
    )
    client = app.test_client()
    # a client that names a new address in each request still draws from its own address's bucket
    assert anonymous_statuses(client, "203.0.113.7", ["198.51.100.1", "198.51.100.2", "198.51.100.3"]) == [
        401,
        401,
        429,
    ]
    # through the trusted proxy, each forwarded client has its own bucket...
    assert anonymous_statuses(client, "10.0.0.1", ["198.51.100.1", "198.51.100.2", "198.51.100.3"]) == [
        401,
        401,
        401,
    ]
    # ...and one client is limited as itself, whatever it puts left of the proxy's entry
    spoofs = ["1.1.1.1, 198.51.100.9", "2.2.2.2, 198.51.100.9", "3.3.3.3, 198.51.100.9"]
    assert anonymous_statuses(client, "10.0.0.1", spoofs) == [401, 401, 429]


def test_the_client_address_walks_the_proxy_chain() -> None:
    proxies = TrustedProxies(lambda environ, start: [], ["10.0.0.0/8", "::1"])
    assert proxies.client("10.0.0.1", "198.51.100.9") == "198.51.100.9"
    assert proxies.client("10.0.0.1", "6.6.6.6, 198.51.100.9, 10.0.0.2") == "198.51.100.9"
    assert proxies.client("::1", "10.1.1.1, 10.0.0.2") == "10.1.1.1"  # all trusted: the leftmost
    assert proxies.client("10.0.0.1", "6.6.6.6, not-an-address") == "10.0.0.1"
    assert proxies.client("10.0.0.1", "") == "10.0.0.1"
    seen: dict[str, str] = {}

    def app(environ, start):
        seen.update(addr=environ["REMOTE_ADDR"], scheme=environ["wsgi.url_scheme"])
        return []

    wrapped = TrustedProxies(app, ["10.0.0.0/8"])
    forwarded = {
        "HTTP_X_FORWARDED_FOR": "198.51.100.9",
        "HTTP_X_FORWARDED_PROTO": "https",
        "wsgi.url_scheme": "http",
    }
    wrapped({**forwarded, "REMOTE_ADDR": "203.0.113.7"}, None)
    assert seen == {"addr": "203.0.113.7", "scheme": "http"}  # not a listed proxy: headers ignored
    wrapped({**forwarded, "REMOTE_ADDR": "10.0.0.1"}, None)
    assert seen == {"addr": "198.51.100.9", "scheme": "https"}
