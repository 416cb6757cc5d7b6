"""Every route of the app, taken from ``app.url_map`` (a new route cannot escape), without a key,
with wrong, revoked and malformed keys, and with another tenant's ids: 401 (console pages: a
redirect to sign-in), 404 for other tenants' objects, nothing of theirs in any body, never a 5xx.
Also: keys are stored as digests only, and checked through a constant-time comparison.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import select, update

from api.app import create_app
from api.services import tenants
from api.services.tenants import authenticate, create_key, create_tenant, hash_key
from storage.models import ApiKey, Base
from storage.runtime import Runtime
from tests.conftest import now
from tests.factories import chat_line, http_upload

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
# routes anyone may call, and why; everything else in the url_map needs a key or a session
PUBLIC = {
    "/healthz": "liveness probe, says only ok",
    "/readyz": "readiness probe: which backing service fails and why (no tenant data, passwords masked)",
    "/openapi.json": "the API's own description, no tenant data",
    "/static/<path:filename>": "the console's stylesheet",
    "/console/sign-in": "the sign-in form (GET) and its submission (POST)",
    "/": "redirects to the console, which asks for sign-in",
    "/metrics": "no tenant key: FREIGHT_METRICS_TOKEN or the FREIGHT_METRICS_BIND listener, tested below",
}
SECRET_NAME = "alpha-confidential-inputs.jsonl"
SECRET_META = "alpha-confidential-project"


@dataclass
class World:
    app: Flask
    rt: Runtime
    key_a: str
    key_b: str
    revoked_a: str
    tenant_a: str
    file_a: str
    batch_a: str
    endpoint_a: str
    upload_a: str

    def secrets(self) -> list[str]:
        """What must never show in a response to anyone but alpha."""
        return [SECRET_NAME, SECRET_META, self.tenant_a, self.key_a, self.revoked_a, "alpha"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def world(settings) -> Iterator[World]:
    # rate limits off: this test sends hundreds of failed keys from one address on purpose
    rt = Runtime(replace(settings, rate_limit_rps=0, rate_limit_anonymous_rps=0))
    app = create_app(runtime=rt)
    tenant_a, key_a = create_tenant(rt.db, "alpha", now())
    _, key_b = create_tenant(rt.db, "beta", now())
    revoked = create_key(rt.db, "alpha", now())
    with rt.db.write() as s:
        s.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(revoked)).values(revoked_at=now()))
    client = app.test_client()
    uploaded = http_upload(client, bearer(key_a), name=SECRET_NAME).get_json()
    batch = client.post(
        "/v1/batches", headers=bearer(key_a),
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "metadata": {"p": SECRET_META}},
    ).get_json()  # fmt: skip
    assert batch["status"] == "validating"
    hook = client.post(
        "/v1/webhooks", headers=bearer(key_a), json={"url": "https://hooks.example.com/a", "events": ["batch.failed"]}
    ).get_json()  # fmt: skip
    upload = client.post(
        "/v1/uploads", headers=bearer(key_a),
        json={"bytes": 10, "filename": SECRET_NAME, "purpose": "batch", "mime_type": "text/jsonl"},
    ).get_json()  # fmt: skip
    yield World(
        app, rt, key_a, key_b, revoked, tenant_a.id, uploaded["id"], batch["id"], hook["id"], upload["id"]
    )
    rt.db.dispose()


def routes(app: Flask) -> list[tuple[str, str, Any]]:
    """(method, rule, werkzeug rule) of every route but the public ones."""
    found = []
    for rule in app.url_map.iter_rules():
        if rule.rule in PUBLIC:
            continue
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            found.append((method, rule.rule, rule))
    return found


def url(rule: Any, values: dict[str, str]) -> str:
    missing = set(rule.arguments) - set(values)
    assert not missing, f"{rule.rule}: add {missing} to the auth matrix (a new route argument)"
    path = rule.rule
    for name in rule.arguments:
        path = re.sub(rf"<(?:[a-z]+:)?{name}>", values[name], path)
    return path


def send(client, method: str, path: str, headers: dict | None = None, csrf: str | None = None):
    """A plausible request for the route: an upload for upload routes, a JSON body for /v1 posts."""
    kw: dict[str, Any] = {"headers": headers or {}}
    if method == "POST" and path.endswith(("/files", "/upload")):
        kw["data"] = {"purpose": "batch", "file": (io.BytesIO(json.dumps(chat_line()).encode()), "x.jsonl")}
        kw["content_type"] = "multipart/form-data"
    elif method == "POST" and path.startswith("/v1"):
        kw["json"] = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions"}
    if path.startswith("/console") and method == "POST":
        kw.setdefault("data", {})
        if csrf:
            kw["data"]["csrf_token"] = csrf
    return client.open(path, method=method, **kw)


def sign_in(app: Flask, key: str):
    client = app.test_client()
    token = CSRF.search(client.get("/console/sign-in").get_data(as_text=True)).group(1)  # type: ignore[union-attr]
    assert client.post("/console/sign-in", data={"api_key": key, "csrf_token": token}).status_code == 302
    return client


def page_csrf(client) -> str:
    return CSRF.search(client.get("/console/sign-in").get_data(as_text=True)).group(1)  # type: ignore[union-attr]


class Tally:
    def __init__(self, world: World) -> None:
        self.world = world
        self.cases = 0
        self.server_errors = 0
        self.leaks: list[str] = []

    def check(self, what: str, response, allowed: tuple[int, ...]) -> None:
        self.cases += 1
        if response.status_code >= 500:
            self.server_errors += 1
        body = response.get_data(as_text=True)
        for secret in self.world.secrets():
            if secret in body or secret in str(response.headers):
                self.leaks.append(f"{what}: {secret[:20]}")
        assert response.status_code in allowed, (what, response.status_code, body[:300])


@pytest.mark.reliability
def test_every_route_refuses_strangers_and_hides_other_tenants(world: World, reliability) -> None:
    app, tally = world.app, Tally(world)
    own = {"file_id": world.file_a, "batch_id": world.batch_a, "kind": "input", "model": "demo", "unknown": "nowhere", "filename": "x", "endpoint_id": world.endpoint_a, "action": "disable", "upload_id": world.upload_a}  # fmt: skip
    fake = {
        **own,
        "file_id": "file-" + "0" * 24,
        "batch_id": "batch_" + "0" * 24,
        "endpoint_id": "whep_" + "0" * 24,
        "upload_id": "upload_" + "0" * 24,
    }
    table = routes(app)
    assert {r for _, r, _ in table} >= {
        "/v1/files",
        "/v1/batches/<batch_id>/cancel",
        "/console/jobs/<batch_id>",
    }
    bad_headers = {
        "no key": {},
        "wrong key": bearer("fk-" + "x" * 43),
        "revoked key": bearer(world.revoked_a),
        "Bearer alone": {"Authorization": "Bearer"},
        "Bearer and space": {"Authorization": "Bearer "},
        "Basic": {"Authorization": "Basic YWxwaGE6cGFzc3dvcmQ="},
        "10 kB key": bearer("k" * 10_240),
        "NUL in key": {"Authorization": f"Bearer {world.key_a[:10]}\x00{world.key_a[10:]}"},
        "key as scheme": {"Authorization": world.key_a},
    }
    alpha_console = sign_in(app, world.key_a)  # a console session does not authenticate /v1
    refused = app.test_client()
    for key in (world.revoked_a, "fk-wrong", "k" * 10_240, world.key_a[:10] + "\x00" + world.key_a[10:]):
        response = refused.post("/console/sign-in", data={"api_key": key, "csrf_token": page_csrf(refused)})
        tally.check(f"POST /console/sign-in [{key[:12]!r}]", response, (401,))
    for method, rule, werkzeug_rule in table:
        path = url(werkzeug_rule, own)
        if rule.startswith("/v1"):
            cases = [(name, app.test_client(), headers) for name, headers in bad_headers.items()]
            cases.append(("console cookie only", alpha_console, {}))
            for name, client, headers in cases:
                response = send(client, method, path, headers)
                tally.check(f"{method} {path} [{name}]", response, (401,))
                error = response.get_json()["error"]
                assert error["type"] == "authentication_error" and error["code"] in (
                    "missing_api_key",
                    "invalid_api_key",
                )
        else:
            # console: no session, a session whose key was revoked, a session signed with another secret
            stale = sign_in(app, create_key(world.rt.db, "alpha", now()))
            with world.rt.db.write() as s:
                s.execute(update(ApiKey).where(ApiKey.revoked_at.is_(None), ApiKey.tenant_id == world.tenant_a, ApiKey.key_hash != hash_key(world.key_a)).values(revoked_at=now()))  # fmt: skip
            forged = app.test_client()
            other = Flask("forger")
            other.secret_key = "not-the-secret"
            cookie = other.session_interface.get_signing_serializer(other).dumps(  # type: ignore[attr-defined]
                {"tenant": world.tenant_a, "key": hash_key(world.key_a), "csrf": "c"}
            )
            forged.set_cookie("session", cookie)
            for name, client in (("no session", app.test_client()), ("revoked session", stale), ("forged session", forged)):  # fmt: skip
                response = send(client, method, path, {}, csrf=page_csrf(client))
                tally.check(f"{method} {path} [{name}]", response, (302,))
                assert "/console/sign-in" in response.location
    # other tenants' ids: beta gets exactly what an id that does not exist gets
    beta_console = sign_in(app, world.key_b)
    for method, rule, werkzeug_rule in table:
        if not {"file_id", "batch_id", "endpoint_id", "upload_id"} & set(werkzeug_rule.arguments):
            continue
        answers = []
        for values in (own, fake):
            path = url(werkzeug_rule, values)
            if rule.startswith("/v1"):
                response = send(app.test_client(), method, path, bearer(world.key_b))
            else:
                response = send(beta_console, method, path, {}, csrf=page_csrf(beta_console))
            tally.check(f"{method} {path} [beta]", response, (404,))
            body = response.get_data(as_text=True)
            for name in ("file_id", "batch_id", "endpoint_id", "upload_id"):
                body = body.replace(values[name], "ID")
            answers.append(body)
        assert answers[0] == answers[1], (method, rule)  # no oracle for "exists, but not yours"
    # nothing of alpha's changed: not deleted, not cancelled, no new object
    a = app.test_client()
    assert (
        a.get(f"/v1/files/{world.file_a}", headers=bearer(world.key_a)).get_json()["filename"] == SECRET_NAME
    )
    assert (
        a.get(f"/v1/batches/{world.batch_a}", headers=bearer(world.key_a)).get_json()["status"]
        == "validating"
    )
    assert len(a.get("/v1/files", headers=bearer(world.key_a)).get_json()["data"]) == 1
    assert len(a.get("/v1/batches", headers=bearer(world.key_a)).get_json()["data"]) == 1
    hooks = a.get("/v1/webhooks", headers=bearer(world.key_a)).get_json()["data"]
    assert [(h["id"], h["status"]) for h in hooks] == [(world.endpoint_a, "active")]
    assert a.get("/v1/batches", headers={"Authorization": f"bearer  {world.key_a}"}).status_code == 200
    reliability.record(
        "auth_matrix", lost=0, duplicated=0, server_errors=tally.server_errors,
        routes=len(table), cases=tally.cases, cross_tenant_leaks=len(tally.leaks),
    )  # fmt: skip
    assert tally.leaks == [] and tally.server_errors == 0


def test_public_routes_show_no_tenant_data(world: World) -> None:
    client = world.app.test_client()
    assert client.get("/healthz").get_json() == {"status": "ok"}
    for path in ("/console/sign-in", "/", "/static/console/console.css"):
        body = client.get(path).get_data(as_text=True)
        assert not any(secret in body for secret in world.secrets())
    assert client.get("/").status_code == 302
    public = {r.rule for r in world.app.url_map.iter_rules()} & set(PUBLIC)
    assert public >= {"/healthz", "/static/<path:filename>", "/console/sign-in", "/metrics"}


def test_metrics_answer_the_token_only(world: World, settings) -> None:
    client = world.app.test_client()
    # no token set: nobody, loopback included (behind a proxy on the host every client is loopback)
    for address in ("127.0.0.1", "::1", "203.0.113.5"):
        refused = client.get("/metrics", environ_base={"REMOTE_ADDR": address})
        assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "metrics_forbidden"
    rt = Runtime(replace(world.rt.settings, metrics_token="scrape-me"))
    try:
        guarded = create_app(runtime=rt).test_client()
        far = {"REMOTE_ADDR": "203.0.113.5"}
        assert guarded.get("/metrics").status_code == 401  # loopback is no key either
        assert guarded.get("/metrics", environ_base=far).status_code == 401
        assert guarded.get("/metrics", environ_base=far, headers=bearer("wrong")).status_code == 401
        assert (
            guarded.get("/metrics", headers=bearer(world.key_a)).status_code == 401
        )  # a tenant key is not it
        scraped = guarded.get("/metrics", environ_base=far, headers=bearer("scrape-me"))
        assert scraped.status_code == 200 and b"freight_batches" in scraped.data
    finally:
        rt.db.dispose()


def test_keys_are_stored_as_digests_only(world: World) -> None:
    with world.rt.db.read() as s:
        stored = {row.key_hash: row for row in s.scalars(select(ApiKey))}
        cells = [
            str(value)
            for table in Base.metadata.sorted_tables
            for row in s.execute(select(table))
            for value in row
            if value is not None
        ]
    for key in (world.key_a, world.key_b, world.revoked_a):
        digest = hashlib.sha256(key.encode()).hexdigest()
        assert digest in stored and len(stored[digest].prefix) <= 10 and key.startswith(stored[digest].prefix)
        assert not any(key in cell or key[10:] in cell for cell in cells), "a plaintext key is stored"


def test_keys_are_compared_in_constant_time(world: World, monkeypatch) -> None:
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenants.hmac, "compare_digest", recording)
    digest = hash_key(world.key_a)
    assert authenticate(world.rt.db, world.key_a) == world.tenant_a
    assert calls == [(digest, digest)]  # the stored digest against the sent key's, nothing plain
    calls.clear()
    ok = world.app.test_client().get("/v1/batches", headers=bearer(world.key_a))
    assert ok.status_code == 200 and (digest, digest) in calls  # the API path goes through it too
    # the comparison decides: with it saying "different", the right key is refused
    monkeypatch.setattr(tenants.hmac, "compare_digest", lambda a, b: False)
    assert authenticate(world.rt.db, world.key_a) is None
    assert world.app.test_client().get("/v1/batches", headers=bearer(world.key_a)).status_code == 401
